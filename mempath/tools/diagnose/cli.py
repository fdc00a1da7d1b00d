"""`mempath diagnose MODEL` and `mempath diagnose A B ...`: the flags, and the table printed after the run
(run.py measures one model, multi.py several)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_diagnose_arguments(parser: argparse.ArgumentParser) -> None:
    from mempath.engine_flags import add_engine_arguments
    parser.add_argument("model", nargs="+",
                        help="model directory (config.json + safetensors); several (DIR or NAME=DIR, as `mempath "
                             "serve` reads them): each model measured, and their shared KV pages")
    add_engine_arguments(parser, model_flag=False)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="several models: the name of each, one per model (default: NAME=, else the directory's)")
    parser.add_argument("--kv-min-share", type=float, default=0.0,
                        help="several models: the fraction of the shared KV pool each one is guaranteed")
    parser.add_argument("--train", action="store_true",
                        help="also measure gradients and AdamW state (transformers model, float32)")
    parser.add_argument("--probe-tokens", type=int, default=2048, help="tokens in the probe forward")
    parser.add_argument("--probe-seqs", type=int, default=8, help="sequences the probe tokens are split into")
    parser.add_argument("--leak-requests", type=int, default=8, help="identical requests for the leak check")
    parser.add_argument("--out", dest="out_dir", default="mempath-diagnose",
                        help="folder for diagnose.json and diagnose.html")
    parser.add_argument("--snapshot", action="store_true",
                        help="also dump a CUDA memory snapshot for pytorch.org/memory_viz")
    parser.add_argument("--open", action="store_true", help="open the HTML report in a browser")


def run_diagnose(args: argparse.Namespace) -> int:
    from mempath.engine_flags import engine_options
    from mempath.tools.diagnose.report import format_table
    from mempath.tools.diagnose.run import diagnose
    options = engine_options(args)
    device, dtype = options.pop("device"), options.pop("dtype")
    if len(args.model) > 1:
        return run_multi_diagnose(args, device, dtype, options)
    if args.kv_min_share or args.served_model_name:
        print("mempath diagnose: error: --kv-min-share and --served-model-name are for several models "
              "(mempath diagnose A B ...)", file=sys.stderr)
        return 2
    return run_and_print(lambda: diagnose(
        args.model[0], device=device, dtype=dtype, train=args.train, probe_tokens=args.probe_tokens,
        probe_seqs=args.probe_seqs, leak_requests=args.leak_requests, out_dir=args.out_dir,
        snapshot=args.snapshot, show_progress=True, progress=progress, **options), format_table, args.open)


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_and_print(measure, format_report, open_html: bool) -> int:
    """Run a diagnose, print its table (and open its HTML): 0, or one line and 3 (out of memory) or 2 (a bad
    flag; or a report that could not be written after the run, whose table is printed first)."""
    from mempath.memory.oom import MempathOutOfMemoryError
    from mempath.tools.diagnose.report import ReportNotWritten
    try:
        report = measure()
    except MempathOutOfMemoryError as error:
        print(f"mempath diagnose: {error}", file=sys.stderr)
        return 3
    except ValueError as error:
        print(f"mempath diagnose: error: {error}", file=sys.stderr)
        return 2
    except ReportNotWritten as error:  # the OSError of writing the files: the measurement is still printed
        print(format_report(error.report))
        print(f"mempath diagnose: error: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    if open_html and report["files"].get("html"):
        import webbrowser
        webbrowser.open(Path(report["files"]["html"]).resolve().as_uri())
    return 0


def run_multi_diagnose(args: argparse.Namespace, device: str, dtype: str, options: dict) -> int:
    """`mempath diagnose A B ...` (multi.py): each model's section, then the shared KV pages'."""
    from mempath.tools.diagnose.multi import diagnose_models
    from mempath.tools.diagnose.multi_report import format_multi_table

    def measure() -> dict:
        if args.train or args.snapshot:
            raise ValueError("--train and --snapshot measure one model: give one model")
        return diagnose_models(args.model, served_model_name=args.served_model_name,
                               kv_min_share=args.kv_min_share, device=device, dtype=dtype,
                               probe_tokens=args.probe_tokens, probe_seqs=args.probe_seqs,
                               leak_requests=args.leak_requests, out_dir=args.out_dir, show_progress=True,
                               progress=progress, **options)
    return run_and_print(measure, format_multi_table, args.open)
