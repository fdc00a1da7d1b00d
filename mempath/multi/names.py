"""Which name each served model answers to: ``NAME=PATH``, ``--served-model-name``, or its directory's name."""
from __future__ import annotations

import os
from pathlib import Path


def split_model_arg(arg: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); a plain path (an existing one may hold '=') -> (None, path)."""
    name, sep, path = arg.partition("=")
    if not sep or not name or "/" in name or Path(arg).exists():
        return None, arg
    return name, path


def served_models(models: list[str], served_names: list[str] | None = None) -> list[tuple[str, str]]:
    """(served name, directory) of each model, in order; refuse what would make names ambiguous."""
    if isinstance(served_names, str):  # one name, as vLLM takes it; not its letters
        served_names = [served_names]
    wrong = next((m for m in models if not isinstance(m, (str, os.PathLike))), None)
    if wrong is not None:
        raise ValueError(f"each model is a directory or NAME=DIR, got {wrong!r}")
    models = [os.fspath(m) for m in models]
    if served_names is not None and any(not isinstance(n, str) or not n.strip() for n in served_names):
        raise ValueError(f"served_model_name: each name must be a non-empty string, got {served_names!r}")
    if served_names and len(served_names) != len(models):
        raise ValueError(f"--served-model-name: give one name per model ({len(models)} models, "
                         f"{len(served_names)} names), or name each one as NAME=PATH")
    pairs = []
    for i, arg in enumerate(models):
        name, path = split_model_arg(arg)
        if served_names:
            if name is not None and name != served_names[i]:
                raise ValueError(f"model {arg!r} is named {name!r} there and {served_names[i]!r} by "
                                 f"--served-model-name: name each model once")
            name = served_names[i]
        pairs.append((name or Path(path).name or path, path))
    seen = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"two models are served as {name!r}; name them apart with NAME=PATH "
                             f"or one --served-model-name per model")
        seen.add(name)
    return pairs
