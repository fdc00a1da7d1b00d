"""mempath's command line: generate | chat | serve | plan | diagnose."""
import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path

from mempath.config import choose_cpu_threads, lookup
from mempath.engine_flags import HelpWithDefaults, add_engine_arguments, engine_options
from mempath.memory.oom import MempathOutOfMemoryError

log = logging.getLogger(__name__)


# Where the command line's defaults differ from SamplingParams' (16 tokens, temperature 1.0):
# a command-line completion is read by a person, greedy and a little longer.
CLI_SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
FROM_CONFIG = "the generation config's if it sets it (--generation-config), else"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"default: {FROM_CONFIG} 64 (SamplingParams' default is 16)")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"default: {FROM_CONFIG} 0, greedy (SamplingParams' default is 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help=f"default: {FROM_CONFIG} 0, off")
    parser.add_argument("--top-p", type=float, default=None, help=f"default: {FROM_CONFIG} 1.0, off")
    parser.add_argument("--min-p", type=float, default=None, help=f"default: {FROM_CONFIG} 0, off")
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")


def sampling_params(args, config_defaults: dict | None = None, warn: bool = False):
    """The flags given, then the generation config's defaults, then the command line's, then SamplingParams'.
    ``warn``: name the flags that greedy decoding makes useless (logged once, for the params that run)."""
    from mempath.sampling import SamplingParams
    values = {**CLI_SAMPLING_DEFAULTS, **(config_defaults or {})}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    unused = [f"--{name.replace('_', '-')} {getattr(args, name)}"
              for name in ("top_k", "top_p", "min_p", "sample_seed") if getattr(args, name) is not None]
    if warn and unused and values.get("temperature") == 0:
        source = ("--temperature 0" if args.temperature is not None else
                  "the generation config's" if "temperature" in (config_defaults or {}) else
                  "the command line's default")
        log.warning("%s %s no effect at temperature 0 (greedy decoding, %s): add --temperature, e.g. "
                    "--temperature 0.7", " and ".join(unused), "has" if len(unused) == 1 else "have", source)
    return SamplingParams(**values, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def resolve_model_and_prompt(args) -> tuple[str | None, str]:
    """`generate PROMPT`, `generate --model DIR PROMPT`, or `generate DIR PROMPT` where DIR exists."""
    words = args.positional
    first_is_dir = lookup(words[0])[0]  # False for a word too long to be a path
    if len(words) == 2 and first_is_dir:
        if args.model:
            raise ValueError("give the model either as --model or as the first argument, not both")
        return words[0], words[1]
    if len(words) == 1 and first_is_dir and (Path(words[0]) / "config.json").is_file():
        raise ValueError(f"generate {words[0]}: no PROMPT after the model directory; give one, quoted: "
                         f"mempath generate {words[0]} \"PROMPT\"")
    if len(words) == 1:
        return args.model, words[0]
    raise ValueError(f"generate takes one PROMPT, got {len(words)} arguments, and {words[0]!r} is not a model "
                     f"directory: quote a prompt that has spaces, and give the model as --model DIR")


def warn_if_cut(output, params, max_model_len: int, args=None, config_defaults: dict | None = None) -> None:
    """Say when max_model_len, not max_tokens, ended the output (the engine stops a sequence at its last position);
    ``args`` and ``config_defaults`` name where max_tokens came from (--max-tokens, the generation config, the
    default)."""
    made = len(output.token_ids)
    if output.finish_reason == "length" and made < params.max_tokens:
        limit = (f"--max-tokens {params.max_tokens}" if args is None or args.max_tokens is not None else
                 f"max_tokens {params.max_tokens} (the generation config's max_new_tokens)"
                 if "max_tokens" in (config_defaults or {}) else f"the default max_tokens {params.max_tokens}")
        log.warning("the output stopped at %d tokens, not %s: its %d-token prompt and the output fill "
                    "--max-model-len %d; raise --max-model-len for a longer output", made, limit,
                    len(output.prompt_token_ids), max_model_len)


def run_generate(args) -> int:
    from mempath.llm import LLM
    model, prompt = resolve_model_and_prompt(args)
    sampling_params(args).validate(args.max_logprobs)  # a bad flag fails before the weights load
    llm = LLM(model, show_progress=not args.quiet, **engine_options(args))
    params = sampling_params(args, llm.sampling_defaults, warn=True)
    try:
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        warn_if_cut(output, params, llm.engine.max_model_len, args, llm.sampling_defaults)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": output.text, "token_ids": output.token_ids,
                              "finish_reason": output.finish_reason,
                              "time_to_first_token": output.time_to_first_token,
                              "total_time": output.total_time}), flush=True)
        else:
            print(prompt + output.text, flush=True)
    finally:
        llm.engine.close()  # after the answer is out: a disk tier keeps what this run cached for the next
    return 0


def run_chat(args) -> int:
    from mempath.llm import LLM
    if len(args.message) > 1:
        words = " ".join(args.message)
        raise ValueError(f'chat takes the message as one argument: quote it, e.g. mempath chat "{words}"')
    from mempath.server.cli import read_chat_template
    template = read_chat_template(args.chat_template)  # before the weights load: a bad one fails at once
    sampling_params(args).validate(args.max_logprobs)  # likewise a bad flag
    llm = LLM(args.model, show_progress=not args.quiet, **engine_options(args))
    params = sampling_params(args, llm.sampling_defaults, warn=True)
    try:
        output = llm.chat([{"role": "user", "content": args.message[0]}], params,
                          use_tqdm=False, chat_template=template)[0]
        warn_if_cut(output, params, llm.engine.max_model_len, args, llm.sampling_defaults)
        print(output.text, flush=True)
    finally:
        llm.engine.close()  # after the answer is out: a disk tier keeps what this run cached for the next
    return 0


GENERATE_USAGE = "mempath generate [--model DIR] [options] PROMPT"
GENERATE_HELP = ("Complete one PROMPT with the model in --model DIR (default: the built-in mempath-tiny). "
                 "`mempath generate DIR PROMPT` also works when DIR is an existing directory; otherwise a "
                 "second argument is an error, never a model name.")


LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mempath", description=__doc__, formatter_class=HelpWithDefaults)
    parser.add_argument("--log-level", default="warning", type=str.lower, choices=LOG_LEVELS,
                        help="default: warning")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = functools.partial(sub.add_parser, formatter_class=HelpWithDefaults)

    gen = add_parser("generate", help="complete a prompt", usage=GENERATE_USAGE, description=GENERATE_HELP)
    gen.add_argument("positional", nargs="+", metavar="PROMPT",
                     help="the prompt, quoted (or an existing model DIR, then the prompt)")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--quiet", action="store_true", help="no progress bars")

    chat = add_parser("chat", help="answer one user message through the chat template",
                      usage="mempath chat [options] MESSAGE")
    chat.add_argument("message", nargs="+", metavar="MESSAGE", help="the user's message, quoted")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)
    from mempath.server.cli import CHAT_TEMPLATE_HELP, add_serve_arguments
    chat.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    chat.add_argument("--quiet", action="store_true", help="no progress bars")

    # Short usage lines: argparse's own lists every option (about 30 lines) above a one-line error.
    add_serve_arguments(add_parser("serve", help="OpenAI-compatible HTTP server",
                                   usage="mempath serve [options] [MODEL ...]"))
    from mempath.tools.plan_cli import add_plan_arguments
    add_plan_arguments(add_parser("plan", help="predict memory per pathway (no GPU needed)",
                                  usage="mempath plan [options] MODEL [MODEL ...]"))
    from mempath.tools.diagnose.cli import add_diagnose_arguments
    add_diagnose_arguments(add_parser("diagnose", help="measure memory per pathway against the plan",
                                      usage="mempath diagnose [options] MODEL [MODEL ...]"))
    return parser


def runs_on_the_cpu(device: str) -> bool:
    import torch
    return device == "cpu" or device.startswith("cpu:") or (device == "auto" and not torch.cuda.is_available())


def run_command(args) -> int:
    from mempath.tools.diagnose.cli import run_diagnose
    from mempath.tools.plan_cli import run_plan
    from mempath.server.cli import run_serve
    commands = {"generate": run_generate, "chat": run_chat, "serve": run_serve, "plan": run_plan,
                "diagnose": run_diagnose}
    try:
        if getattr(args, "refused", None):
            raise ValueError(args.refused)
        if args.command != "plan" and runs_on_the_cpu(args.device):
            log.info(choose_cpu_threads())
        return commands[args.command](args)
    except ValueError as error:  # bad input, a broken config or checkpoint (CheckpointError): one line
        print(f"mempath: error: {error}", file=sys.stderr)
        return 2
    except MempathOutOfMemoryError as error:  # the explanation, its ledger and fixes; as diagnose exits
        print(f"mempath: {error}", file=sys.stderr)
        return 3


def main(argv: list[str] | None = None) -> int:
    sys.stdout = CheckedOutput(sys.stdout)
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        code = run_command(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`mempath plan --json | head`): stop quietly, as Unix tools do.
        _stdout_to_devnull()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except KeyboardInterrupt:
        print("mempath: interrupted", file=sys.stderr)
        return 130
    except OutputError as error:
        print(f"mempath: error: cannot write the output ({error})", file=sys.stderr)
        _stdout_to_devnull()
        return 1
    finally:
        if isinstance(sys.stdout, CheckedOutput):
            sys.stdout = sys.stdout.stream


class OutputError(Exception):
    """Writing the command's output failed (a full disk, an I/O error): one line, not the write's traceback."""


class CheckedOutput:
    """stdout, with a failed write (other than a closed pipe, which main stops on quietly) raised as OutputError,
    so that main can tell it from an error of the engine's own files."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if self.stream is None:  # started with stdout closed: the output has nowhere to go
            raise OutputError("stdout is closed")
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as error:
            raise OutputError(error.strerror) from None

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as error:
            raise OutputError(error.strerror) from None

    def __getattr__(self, name):
        if name == "stream" or self.__dict__.get("stream") is None:  # copy.copy probes before __init__ runs
            raise AttributeError(name)
        return getattr(self.stream, name)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, or the interpreter's final flush raises again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
