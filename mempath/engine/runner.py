"""ModelRunner: owns the KV cache tensor, turns a scheduled batch into model inputs,
runs the model and samples."""
import numpy as np
import torch

from mempath.config import EngineConfig
from mempath.engine.request import Request
from mempath.engine.sampler import Sampler, SamplerOutput
from mempath.engine.scheduler import ScheduledBatch
from mempath.model.llama import AttentionMetadata, CausalLM, ModelSpec


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, spec: ModelSpec,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.sampler = Sampler(device, config.seed)
        self.kv_cache = torch.empty(0)

    def kv_bytes_per_block(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        self.kv_cache = torch.empty(
            s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim,
            dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[i, 0]
            attn.v_cache = self.kv_cache[i, 1]

    def prepare(self, batch: ScheduledBatch, sampling: set[int]):
        """Flatten the batch: token ids, positions, slots, block tables, logit rows."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_start_loc = [0]
        seq_lens = []
        logits_rows = []
        max_blocks = max(len(r.block_table) for r in batch.requests)
        block_tables = np.zeros((len(batch.requests), max_blocks), dtype=np.int32)
        for b, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.token_ids[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            table = np.asarray(request.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            block_tables[b, :len(request.block_table)] = request.block_table
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if id(request) in sampling:
                logits_rows.append(query_start_loc[-1] - 1)

        def to_device(array, dtype):
            return torch.from_numpy(np.asarray(array)).to(self.device, dtype)

        meta = AttentionMetadata(
            slot_mapping=to_device(np.concatenate(slots), torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return (to_device(input_ids, torch.int64), to_device(np.concatenate(positions), torch.int64),
                meta, to_device(logits_rows, torch.int64))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sampling: list[Request]) -> SamplerOutput | None:
        """Run one step; sample for the requests in `sampling` (in batch order)."""
        input_ids, positions, meta, logits_rows = self.prepare(batch, {id(r) for r in sampling})
        hidden = self.model(input_ids, positions, meta)
        if not sampling:
            return None
        logits = self.model.compute_logits(hidden[logits_rows])
        return self.sampler(logits, [r.params for r in sampling], [r.generator for r in sampling])
