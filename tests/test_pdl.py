"""Programmatic dependent launch: the rule every Triton kernel follows, and the mechanism.

A kernel launched with ``launch_pdl`` may run while the kernel before it is still
writing. Each of ours calls ``pdl_wait`` before touching anything but its weights;
the first test checks that in the source of every kernel (CPU, always runs). The
GPU test shows that the overlap is real, eagerly and inside a CUDA graph (a
consumer that skips the wait reads the producer's buffer before it is written),
and that ``pdl_wait`` orders the consumer after the producer.
"""
import ast
import inspect
import textwrap

import pytest
import torch

from mempath.kernels import attention_triton, common, elementwise_triton, fp8_gemm_triton, moe_triton, quant_triton

# Names of pointers a kernel may read before its wait: weights, never written by a kernel.
READ_BEFORE_WAIT = {"w_ptr", "w_rows"}


def _kernels(module):
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            yield node


def _calls(node, name):
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and (getattr(c.func, "attr", None) == name or getattr(c.func, "id", None) == name)]


@pytest.mark.parametrize("module", [attention_triton, elementwise_triton, quant_triton, fp8_gemm_triton, moe_triton],
                         ids=lambda m: m.__name__)
def test_every_kernel_waits_before_touching_activations(module):
    kernels = list(_kernels(module))
    assert kernels, "no kernels found: the check would pass vacuously"
    for kernel in kernels:
        assert "PDL" in [a.arg for a in kernel.args.args], f"{kernel.name} has no PDL parameter"
        waits = [i for i, stmt in enumerate(kernel.body) if _calls(stmt, "pdl_wait")]
        assert waits, f"{kernel.name} never calls pdl_wait at its top level"
        for stmt in kernel.body[:waits[0]]:
            code = textwrap.shorten(ast.unparse(stmt), 80)
            assert not any(isinstance(n, ast.Return) for n in ast.walk(stmt)), f"{kernel.name}: {code}"
            assert not _calls(stmt, "store"), f"{kernel.name} stores before its wait: {code}"
            for load in _calls(stmt, "load"):
                names = {n.id for n in ast.walk(load.args[0]) if isinstance(n, ast.Name)}
                assert names & READ_BEFORE_WAIT, f"{kernel.name} reads before its wait: {code}"


def test_pdl_is_off_without_cuda():
    assert common.pdl_options(torch.device("cpu")) == {"PDL": False}


needs_pdl = pytest.mark.skipif(
    not torch.cuda.is_available() or not common.use_pdl(torch.device("cuda")),
    reason="programmatic dependent launch needs Hopper or later and Triton >= 3.4")

if common.HAS_TRITON and common.HAS_PDL:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    from mempath.kernels.common import pdl_wait

    @triton.jit
    def _slow_producer(buf_ptr, spins, BLOCK: tl.constexpr):
        # Release the dependent kernel at once, then spin before writing.
        gdc_launch_dependents()
        acc = tl.program_id(0).to(tl.float32)
        for _ in range(spins):
            acc = acc * 0.999 + 1.0
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(buf_ptr + offs, tl.where(acc > -1.0, 1.0, 2.0))

    @triton.jit
    def _consumer(buf_ptr, out_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(buf_ptr + offs))


@needs_pdl
def test_pdl_wait_orders_a_consumer_after_its_producer():
    block, programs = 256, 4

    def run(wait, buf, out):
        buf.zero_()
        _slow_producer[(programs,)](buf, 200_000, BLOCK=block)
        _consumer[(programs,)](buf, out, BLOCK=block, PDL=wait, launch_pdl=True)

    buf = torch.zeros(programs * block, device="cuda")
    out = torch.empty_like(buf)
    for wait in (False, True):  # compile first: a compile between the launches hides any overlap
        run(wait, buf, out)
    torch.cuda.synchronize()
    results = {}
    for wait in (False, True):
        run(wait, buf, out)
        torch.cuda.synchronize()
        results["eager", wait] = out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(wait, buf, out)
        out.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        results["graph", wait] = out.clone()
    for mode in ("eager", "graph"):
        assert (results[mode, True] == 1.0).all(), f"{mode}: the waiting consumer read unwritten values"
        # Without the wait the consumer overlaps the spinning producer: PDL is really in effect.
        assert (results[mode, False] == 0.0).any(), f"{mode}: no overlap, programmatic launch did nothing"
