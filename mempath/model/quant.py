"""fp8 weights (``quantization="fp8"``): the quantize arithmetic and the fp8 linear layer.

A quantized linear holds its weight in float8_e4m3fn, one float32 scale per output
channel (row), and its bias in the model dtype. Its input is quantized per token (per
row) on the fly: scale = amax(|row|) / 448, stored = round-to-nearest-even of row / scale,
clamped to e4m3's finite range. On CUDA the product is Hopper's fp8 matmul
(``torch._scaled_mm`` with row-wise scales, float32 accumulation, or the Triton fp8 GEMM where its
table lists the batch); elsewhere the PyTorch
path dequantizes both operands with the same arithmetic and runs a float32 matmul: it is
the oracle of the CUDA path and the CPU path. At decode batches on CUDA (the Triton kernels)
an fp8 GEMV (mempath.kernels.fp8_gemv_triton, twin ``fp8_gemv_torch``) reads the weight once,
weight-only or with the activations quantized per 128 values, as its table says per shape and
batch. Which one a layer runs is decided once, when the model is built for a device
(``set_fp8_matmul``), as for mempath.kernels.

The loader fills a layer either from a float checkpoint tensor, quantized as it arrives
(``copy_quantized``), or from a pre-quantized one (float8 weights and their
``weight_scale``; docs/quantization.md).
"""
import dataclasses
import functools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mempath.constants import FP8_MAX, MIN_SCALE
from mempath.model.spec import CheckpointError

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
# A scale is amax times this float32 reciprocal, not amax / 448: PyTorch's CUDA division by a
# scalar is a multiplication by its reciprocal, so a multiplication is the one arithmetic the
# twin, the Triton kernel and the CPU all do alike.
INV_FP8_MAX = 1.0 / FP8_MAX
# Hopper's fp8 matmul needs both of a weight's dimensions to be multiples of 16.
SCALED_MM_ALIGNMENT = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8_e4m3fn, float32 scales [..., 1]): one scale per row of the last dimension.

    The same arithmetic quantizes a weight per output channel at load and an
    activation per token in every step. One float32 copy of ``x`` is made and
    reused in place (the profile step measures it on CUDA).
    """
    scale = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_(min=MIN_SCALE).mul_(INV_FP8_MAX)
    scaled = x.to(torch.float32, copy=True).div_(scale).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of a quantized tensor: q · scale (scale broadcast over each row)."""
    return q.to(torch.float32) * scale


class Fp8Activation(NamedTuple):
    """A projection's input already quantized per token (``quantize_rows``' arithmetic) by the kernel
    that produced it: ``values`` float8_e4m3fn [rows, in], ``scale`` float32 [rows, 1], and ``dtype``,
    the model dtype the values stand for (the projection's output dtype)."""
    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def scaled_mm_quantized(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One fp8 matmul of a per-token quantized input with row-wise scales, the result in ``dtype``.

    ``torch._scaled_mm`` takes the weight column-major (the transpose of our row-major
    [out, in] storage, no copy) and, with row-wise scales, writes bfloat16 only; another
    model dtype gets a cast.
    """
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out += bias
    return out if dtype == torch.bfloat16 else out.to(dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, quantize=quantize_rows) -> torch.Tensor:
    """The CUDA path: x quantized per token (``quantize``: quantize_rows or its fused Triton twin),
    then ``scaled_mm_quantized``."""
    xq, x_scale = quantize(x)
    return scaled_mm_quantized(xq, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The PyTorch path (the oracle): x quantized per token, both operands dequantized, a float32
    matmul, the bias added, the result in x's dtype."""
    return fp8_linear_quantized_torch(Fp8Activation(*quantize_rows(x), x.dtype), weight, weight_scale, bias)


def fp8_linear_quantized_torch(x: Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                               bias: torch.Tensor | None) -> torch.Tensor:
    """``fp8_linear_torch`` of an input quantized beforehand."""
    out = dequantize_rows(x.values, x.scale) @ dequantize_rows(weight, weight_scale).t()
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(x.dtype)


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """float32 values of a 2-D ``x`` quantized by ``quantize_rows`` in groups of ``group`` along a
    row (the last group zero-padded), dequantized: what the GEMV's fp8 tensor-core product sees."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, -k % group)).view(rows, -1, group)
    return dequantize_rows(*quantize_rows(padded)).view(rows, -1)[:, :k]


def fp8_gemv_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, x_group: int | None = None) -> torch.Tensor:
    """The twin of the CUDA GEMV (mempath.kernels.fp8_gemv_triton): x in its dtype (weight-only fp8),
    or with ``x_group`` quantized in groups of that many along K (``quantize_groups``); the float32
    product with the fp8 weight is scaled per output channel, the bias added, the result in x's dtype."""
    xf = x.to(torch.float32) if x_group is None else quantize_groups(x, x_group)
    out = (xf @ weight.to(torch.float32).t()) * weight_scale.view(1, -1)
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(x.dtype)


def fp8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    gemv, quantize=quantize_rows, gemm=None) -> torch.Tensor:
    """CUDA with the Triton kernels: decode batches (at most GEMV_MAX_ROWS rows) run the fp8
    GEMV (``gemv``: a kernels.fp8_gemv_triton.Fp8Gemv) with the configuration its table gives the
    shape and batch bucket; larger batches, buckets the table sends there and float32 activations
    (the GEMV's tensor-core product takes 16-bit ones) are quantized per token (``quantize``) and
    multiplied by ``fp8_linear_quantized_cuda``."""
    config = gemv_config(gemv, weight, x.shape[0], x.dtype)
    if config is not None:
        return gemv(x, weight, weight_scale, bias, config)
    return fp8_linear_quantized_cuda(Fp8Activation(*quantize(x), x.dtype), weight, weight_scale, bias, gemm)


def gemv_config(gemv, weight: torch.Tensor, rows: int, dtype: torch.dtype):
    """The GEMV launch ``fp8_linear_cuda`` gives ``rows`` rows of ``dtype`` through this weight, or None:
    they take the quantized path (the fp8 GEMM or _scaled_mm), whose input is quantized per token."""
    from mempath.kernels.fp8_gemv_triton import GEMV_MAX_ROWS
    if 0 < rows <= GEMV_MAX_ROWS and dtype != torch.float32:
        config = gemv.config(weight.shape[0], weight.shape[1], rows)
        if config.kernel == "gemv":
            return config
    return None


def gemv_table_for(table: dict, gemm) -> dict:
    """The fp8 GEMV ``table`` as this model runs it: a bucket it hands to the fp8 GEMM ("gemm") keeps the entry's
    own GEMV tile where ``gemm`` (the model's kernels.fp8_gemm_triton.Fp8Gemm; None before Hopper) has no tile
    for it, since _scaled_mm was slower than both at those rows (BENCHMARKS.md, thirty-fourth session)."""
    def runs(shape: str, bucket: str, config):
        if config.kernel == "gemm" and (gemm is None or bucket not in gemm.table.get(shape, {})):
            return dataclasses.replace(config, kernel="gemv")
        return config
    return {shape: {bucket: runs(shape, bucket, config) for bucket, config in buckets.items()}
            for shape, buckets in table.items()}


class Fp8Linear(nn.Module):
    """A linear layer with float8_e4m3fn weights, per-output-channel scales and per-token
    activation scales (module docstring). Parameters as the loader names them: ``weight``
    [out, in] float8, ``weight_scale`` [out, 1] float32, ``bias`` [out] in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul = fp8_linear_torch  # set_fp8_matmul chooses, once, for the model's device
        # The product of an Fp8Activation, and which row counts the layer wants one for (None: never);
        # set_fp8_matmul sets both where the kernel before the layer can quantize its output.
        self.matmul_quantized = fp8_linear_quantized_torch
        self.wants_quantized = None

    def takes_quantized(self, rows: int) -> bool:
        """Whether an input of ``rows`` rows should reach this layer as an Fp8Activation: the layer
        would quantize it per token itself, so the kernel that makes it can do it instead."""
        return self.wants_quantized is not None and self.wants_quantized(rows)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return self.matmul_quantized(x, self.weight, self.weight_scale, self.bias)
        rows = x.reshape(-1, self.in_features)
        return self.matmul(rows, self.weight, self.weight_scale, self.bias).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


class Linear(nn.Linear):
    """nn.Linear whose product set_dense_gemv may send to the GEMV kernel at decode batches
    (``matmul``: F.linear until then). ``projection``: a decoder projection (the GEMV's workspace
    is sized by the widest), not the LM head."""

    def __init__(self, in_features: int, out_features: int, bias: bool, projection: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.projection = projection
        self.matmul = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def takes_quantized(self, rows: int) -> bool:
        """A 16-bit layer takes its input as it is (Fp8Linear.takes_quantized)."""
        return False


def make_linear(in_features: int, out_features: int, bias: bool, quantization: str | None) -> nn.Module:
    """The decoder's q/k/v, o, gate/up and down projections: fp8 when the model is quantized."""
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias)
    return Linear(in_features, out_features, bias)


def fp8_layers(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def _require_fp8_device(device: torch.device, what: str, uses: str, fix: str) -> None:
    """Refuse, in one line, a CUDA device before compute capability 8.9 (Ada), the first with fp8:
    ``what`` needs it for ``uses``; ``fix`` says what to do instead."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"{what} needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper: {uses}); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: {fix}")


def check_fp8_device(device: torch.device, source: str) -> None:
    """Refuse, in one line naming the fix, a CUDA device without an fp8 matmul."""
    _require_fp8_device(device, f"{source}: --quantization fp8", "fp8 matrix multiply",
                        "serve the model unquantized (drop --quantization, or use the checkpoint's bfloat16 version)")


def check_fp8_kv_device(device: torch.device, kv_cache_dtype: str) -> None:
    """Refuse, in one line naming the fix, an fp8 KV cache on a CUDA device whose attention kernels would have
    no fp8 conversions: the Triton kernels convert e4m3 and e5m2 with instructions of compute capability 8.9."""
    if kv_cache_dtype != "auto":
        _require_fp8_device(device, f"--kv-cache-dtype {kv_cache_dtype}", "fp8 conversions in the attention kernels",
                            "drop --kv-cache-dtype (the cache then holds the model's dtype)")


def set_fp8_matmul(model: nn.Module, device: torch.device) -> None:
    """Every fp8 layer of ``model`` runs Hopper's fp8 matmul on CUDA, the PyTorch path elsewhere.
    Where the model runs the Triton kernels (``model.kernels``, mempath.kernels.dispatch), decode
    batches run the weight-only fp8 GEMV (``fp8_linear_cuda``; its workspace is ``model.fp8_gemv``,
    counted by fp8_gemv_bytes), larger ones the fp8 GEMM where its table lists the batch (Hopper only: the
    table's tiles were measured there) and _scaled_mm elsewhere, their input quantized by a Triton kernel."""
    cuda = device.type == "cuda"
    layers = fp8_layers(model)
    matmul = fp8_linear_scaled_mm if cuda else fp8_linear_torch
    model.fp8_gemv = model.fp8_gemm = None
    if cuda and model.kernels.triton and layers:
        from mempath.kernels.fp8_gemm_triton import Fp8Gemm
        from mempath.kernels.fp8_gemv_triton import Fp8Gemv, load_table
        from mempath.kernels.quant_triton import triton_quantize_rows
        hopper = torch.cuda.get_device_capability(device)[0] == 9
        model.fp8_gemm = Fp8Gemm() if USE_FP8_GEMM and hopper else None
        model.fp8_gemv = Fp8Gemv(max(layer.out_features for layer in layers), device,
                                 table=gemv_table_for(load_table(), model.fp8_gemm))
        matmul = functools.partial(fp8_linear_cuda, gemv=model.fp8_gemv, gemm=model.fp8_gemm,
                                   quantize=functools.partial(triton_quantize_rows, fp8_max=FP8_MAX,
                                                              min_scale=MIN_SCALE))
    for layer in layers:
        if cuda and (layer.in_features % SCALED_MM_ALIGNMENT or layer.out_features % SCALED_MM_ALIGNMENT):
            raise ValueError(f"--quantization fp8 on CUDA needs linear layers whose sizes are multiples of "
                             f"{SCALED_MM_ALIGNMENT} (the fp8 matmul's tile); one is {layer.in_features} -> "
                             f"{layer.out_features}: serve this model unquantized")
        layer.matmul = matmul
        if model.fp8_gemv is not None and USE_FUSED_QUANT:
            layer.matmul_quantized = functools.partial(fp8_linear_quantized_cuda, gemm=model.fp8_gemm)
            layer.wants_quantized = functools.partial(_quantized_rows, model.fp8_gemv, layer.weight,
                                                      model.lm_head.weight.dtype)


# Set to False to run every quantized fp8 product on _scaled_mm (A/B measurements: bench_mix --fp8-gemm
# table,scaled-mm); True: the Triton fp8 GEMM where its table (mempath/assets/fp8_gemm_configs.json) lists the
# projection's shape and batch bucket.
USE_FP8_GEMM = True

# Set to False to quantize every fp8 projection's input in its own launch (A/B measurements:
# bench_mix --quant-fusion fused,unfused); True: the RMSNorm and SiLU-and-mul kernels before a
# projection that runs the quantized path (fp8 GEMM or _scaled_mm) write its fp8 input (mempath.kernels.quant_triton).
USE_FUSED_QUANT = True


def _quantized_rows(gemv, weight: torch.Tensor, dtype: torch.dtype, rows: int) -> bool:
    """Whether ``rows`` rows through ``weight`` take the quantized path (not the GEMV)."""
    return rows > 0 and gemv_config(gemv, weight, rows, dtype) is None


def fp8_linear_quantized_cuda(x: Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                              bias: torch.Tensor | None, gemm=None) -> torch.Tensor:
    """The product of a quantized input on CUDA: the Triton fp8 GEMM where ``gemm`` (a
    kernels.fp8_gemm_triton.Fp8Gemm) lists the shape at this batch bucket, else _scaled_mm."""
    config = gemm.config(weight.shape[0], weight.shape[1], x.values.shape[0]) if gemm is not None else None
    if config is not None:
        return gemm(x.values, x.scale, weight, weight_scale, bias, x.dtype, config)
    return scaled_mm_quantized(x.values, x.scale, weight, weight_scale, bias, x.dtype)


# Set to False to leave 16-bit layers to F.linear at decode batches too (A/B measurements:
# bench_engine --variants no-dense-gemv).
USE_DENSE_GEMV = True


def dense_linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a 16-bit layer: the GEMV (``gemv``: a kernels.fp8_gemv_triton.Fp8Gemv
    over the dense table) where the table lists the layer's shape at x's batch bucket, else F.linear. A TMA
    entry where the TMA cannot run (before Hopper) is F.linear too: the table measured those tiles against
    cuBLAS, not the tiles' fallback product."""
    from mempath.kernels.fp8_gemv_triton import GEMV_MAX_ROWS, row_bucket, tma_fits
    n, k = weight.shape
    rows = x.numel() // k
    config = gemv.tabled_config(n, k, rows) if 0 < rows <= GEMV_MAX_ROWS else None
    if config is not None and config.tma and not tma_fits(weight, rows):
        gemv.chosen[f"{n}x{k} rows<={row_bucket(rows)}"] = "cuBLAS (F.linear; the table's tma cannot run here)"
        config = None
    if config is None:
        return F.linear(x, weight, bias)
    return gemv(x.reshape(rows, k), weight, None, bias, config).view(*x.shape[:-1], n)


def set_dense_gemv(model: nn.Module, device: torch.device) -> None:
    """A 16-bit model on CUDA with the Triton kernels: its Linear layers (projections, LM head) run
    dense_linear_cuda, so decode batches of the shapes the dense table lists take the GEMV kernel
    (mempath/assets/dense_gemv_configs.json, written by benchmarks/bench_dense_gemv.py: measured
    faster than cuBLAS there, as the step runs them, each after a kernel launched with PDL). Its
    split-K workspace is ``model.fp8_gemv``, sized by the widest projection (fp8_gemv_bytes,
    memory.formulas.gemv_workspace_bytes); an fp8 model keeps its own (set_fp8_matmul)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if (device.type != "cuda" or not model.kernels.triton or fp8_layers(model) or not linears
            or linears[0].weight.dtype not in (torch.bfloat16, torch.float16)):
        return
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, load_dense_table
    widest = max(m.out_features for m in linears if m.projection)
    model.fp8_gemv = Fp8Gemv(widest, device, table=load_dense_table())
    if USE_DENSE_GEMV:
        for layer in linears:
            layer.matmul = functools.partial(dense_linear_cuda, gemv=model.fp8_gemv)


def fp8_gemv_bytes(model: nn.Module) -> int:
    """Device bytes of the model's fp8 GEMV workspace (memory.formulas.gemv_workspace_bytes), 0 without one."""
    gemv = getattr(model, "fp8_gemv", None)
    return gemv.workspace.nbytes() if gemv is not None else 0


# ---------------------------------------------------------------- loading


def quantized_targets(model: nn.Module) -> dict[str, str]:
    """weight parameter name -> its scale's name, for every Fp8Linear of ``model``."""
    names = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            names[f"{module_name}.weight"] = f"{module_name}.weight_scale"
    return names


def copy_quantized(weight_slice: torch.Tensor, scale_slice: torch.Tensor, tensor: torch.Tensor) -> None:
    """Quantize a float checkpoint tensor per row on the weight's device and store both parts.

    The tensor is moved to the device first, so the quantization runs there (fast on
    CUDA) and the device holds one tensor's float copy at a time, never the model's.
    """
    q, scale = quantize_rows(tensor.to(weight_slice.device))
    weight_slice.copy_(q)
    scale_slice.copy_(scale)


def copy_scale(scale_slice: torch.Tensor, tensor: torch.Tensor) -> bool:
    """A pre-quantized checkpoint's weight_scale into its slice: per channel ([rows] or [rows, 1])
    or per tensor (one value, repeated over the rows). False when its size fits neither."""
    rows = scale_slice.shape[0]
    if tensor.numel() == 1:
        scale_slice.fill_(tensor.reshape(()).item())
        return True
    if tensor.numel() != rows or tensor.dim() > 2 or (tensor.dim() == 2 and tensor.shape[1] != 1):
        return False
    scale_slice.copy_(tensor.reshape(rows, 1))
    return True


def scale_problem(scale: torch.Tensor) -> str | None:
    """What is wrong with a checkpoint's weight_scale, read as it is stored (float32: a float64 beyond its
    range becomes infinity): a scale is a row's largest magnitude over the fp8 maximum, so never negative,
    never NaN, and a layer whose scales are all zero would output zeros. None when it is fine."""
    values = scale.reshape(-1).to(torch.float32)
    bad = values[~torch.isfinite(values)]
    if bad.numel():
        return f"holds {bad.numel()} value(s) that are not finite (e.g. {bad[0].item()}) as the float32 it is kept in"
    if (values < 0).any():
        return f"holds {int((values < 0).sum())} negative value(s)"
    return "is all zero" if not values.any() else None


def fp8_nan_count(tensor: torch.Tensor) -> int:
    """float8_e4m3fn has no infinity, and its NaN (exponent and mantissa all ones) is no weight a quantizer
    writes: in a checkpoint it is damage. Counted only where the largest magnitude code is NaN's: a bool sum over
    every weight took 40 times the weight's copy on the CPU, the maximum about as long as the copy."""
    magnitudes = tensor.view(torch.uint8) & 0x7F
    if not magnitudes.numel() or magnitudes.max().item() != 0x7F:
        return 0
    return int((magnitudes == 0x7F).sum())


def check_fp8_mix(quantized_here: dict[str, tuple], scaled: set[str], fp8_weights: int, source: str) -> None:
    """A float weight bound for an fp8 layer is quantized at load with scales of its own. Refused where the
    checkpoint also holds a weight_scale for it: that scale is for float8 values, and copied over the load's
    own it would give wrong weights without a word. Said in a warning otherwise: the checkpoint left these
    unquantized, which mempath's fp8 layers cannot be (``quantized_here``: weight name -> (file, dtype))."""
    clash = sorted(set(quantized_here) & scaled)
    if clash:
        where, dtype = quantized_here[clash[0]]
        raise CheckpointError(f"{where}: tensor '{clash[0]}.weight' is {dtype} but the checkpoint also has its "
                              f"weight_scale, which scales float8_e4m3fn values ({len(clash)} such weight(s)); "
                              f"the checkpoint is damaged or mixes two exports: download it again")
    if not quantized_here:
        return
    first = min(quantized_here)
    if not fp8_weights:  # the unquantized export under an fp8 config.json, most likely
        log.warning("%s: config.json says fp8, but none of its %d projection weights is fp8 (e.g. %r, %s): all were "
                    "quantized at load, as --quantization fp8 does; its quantization_config does not describe "
                    "these weights", source, len(quantized_here), f"{first}.weight",
                    quantized_here[first][1])
        return
    log.warning("%s: %d projection weight(s) of this fp8 checkpoint are not fp8 (e.g. %r, %s): the checkpoint "
                "leaves them unquantized, but its config.json does not say so (quantization_config's ignore "
                "list, or ignored_layers for quant_method fp8, keeps the projections it names in 16 bits), so "
                "these were quantized at load", source, len(quantized_here), f"{first}.weight",
                quantized_here[first][1])
