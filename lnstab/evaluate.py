"""``lnstab evaluate --config X.yaml --ckpt run/checkpoints/last.ckpt``: the final evaluation of a checkpoint.

The YAML chain (``extends:``) is read as the training CLI reads it (later files win, dicts merge, a changed
``class_path`` replaces its ``init_args``); its ``model`` section must describe the checkpoint's architecture (each
field is checked against the checkpoint's hyperparameters and every weight's shape against the state dict) and its
``data`` section builds the datamodule whose ``validation_tokens()`` are evaluated. Evaluation settings default to
the ``FinalEvaluation`` callback's ``init_args`` in the config, if it lists one, then to the callback's defaults;
flags override both. The record goes to ``eval.json`` in the checkpoint's run directory (the folder above
``checkpoints/``) or ``--out``; an existing ``eval.json`` is never overwritten (``eval-1.json``, … instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from lnstab.cli import expand_extends
from lnstab.errors import LNStabError
from lnstab.evaluation import PROTOCOLS, evaluate_model, write_eval_json
from lnstab.model import GPT, GPTConfig
from lnstab.module import gpt_config

SETTINGS = ("protocol", "n_samples", "seed", "batch_size", "block_size", "prompt_tokens", "new_tokens", "greedy",
            "temperature", "top_k", "bertscore_model", "bertscore_layers", "bertscore_batch_size")
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "dropout")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line through the CLI's LNStabError handler, exit 2
        raise LNStabError(f"lnstab evaluate: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The ``lnstab evaluate`` argument parser (unset flags are ``None`` so config values can fill them)."""
    p = _Parser(prog="lnstab evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", required=True, help="Experiment YAML (repeatable, later wins).")
    p.add_argument("--ckpt", required=True, help="Lightning checkpoint of a GPTModule.")
    p.add_argument("--out", default=None, help="Directory for eval.json (default: the checkpoint's run directory).")
    p.add_argument("--protocol", choices=PROTOCOLS, default=None)
    for name in ("n_samples", "seed", "batch_size", "block_size", "prompt_tokens", "new_tokens", "top_k",
                 "bertscore_layers", "bertscore_batch_size"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--sample", dest="greedy", action="store_false", default=None, help="Sample instead of greedy.")
    p.add_argument("--bertscore_model", default=None, help="Model directory or hub name (default: offline MiniLM).")
    p.add_argument("--device", default=None, help="Device for the model (default: cuda if available, else cpu).")
    return p


def load_config(paths: list[str]) -> dict[str, Any]:
    """The merged YAML of ``paths`` with their ``extends`` chains (base first)."""
    args = expand_extends([a for p in paths for a in ("--config", p)])
    merged: dict[str, Any] = {}
    for path in args[1::2]:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise LNStabError(f"--config {path} is not allowed; it must hold a YAML mapping")
        merged = _merge(merged, data)
    return merged


def _merge(base: Any, new: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(new, dict)):
        return new
    if "class_path" in new and base.get("class_path") not in (None, new["class_path"]):
        return new
    out = dict(base)
    for key, value in new.items():
        out[key] = _merge(out.get(key), value)
    return out


def load_checked_model(ckpt_path: str, config: GPTConfig) -> tuple[GPT, dict[str, Any]]:
    """The GPT of a Lightning checkpoint, after checking it has ``config``'s architecture; and the checkpoint."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise LNStabError(f"--ckpt {ckpt_path} is not a file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error here
        raise LNStabError(f"--ckpt {ckpt_path} is not a readable checkpoint ({type(exc).__name__})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise LNStabError(f"--ckpt {ckpt_path} is not allowed; it must be a Lightning checkpoint with a state_dict")
    hp = ckpt.get("hyper_parameters")
    if isinstance(hp, dict):
        try:
            theirs = gpt_config(hp)
        except LNStabError as exc:
            raise LNStabError(f"--ckpt {ckpt_path}: its hyper_parameters are not a GPTModule's ({exc})") from None
        for name in ARCH_FIELDS:
            a, b = getattr(theirs, name), getattr(config, name)
            if a != b:
                raise LNStabError(
                    f"--ckpt {ckpt_path}: the checkpoint's {name}={a!r} does not match the config's {name}={b!r}; "
                    f"evaluate with the config the checkpoint was trained with"
                )
    state = {}
    for key, value in ckpt["state_dict"].items():
        if key.startswith("model."):
            state[key[len("model.") :].replace("_orig_mod.", "")] = value
    with torch.device("meta"):
        expected = {k: v.shape for k, v in GPT(config).state_dict().items()}
    for key, shape in expected.items():
        if key not in state:
            raise LNStabError(f"--ckpt {ckpt_path}: weight {key} is missing; the config's architecture needs it")
        if tuple(state[key].shape) != tuple(shape):
            raise LNStabError(
                f"--ckpt {ckpt_path}: weight {key} has shape {tuple(state[key].shape)}, the config's architecture "
                f"needs {tuple(shape)}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise LNStabError(f"--ckpt {ckpt_path}: weight {extra[0]} is not part of the config's architecture")
    model = GPT(config)
    model.load_state_dict(state)
    return model, ckpt


def build_datamodule(data: dict[str, Any], block_size: int) -> Any:
    """Instantiate the config's ``data`` (``class_path`` + ``init_args``, ``block_size`` linked to the model's)."""
    class_path = data.get("class_path") if isinstance(data, dict) else None
    if not isinstance(class_path, str) or "." not in class_path:
        raise LNStabError(f"data.class_path={class_path!r} is not allowed; it must be a dotted class path")
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise LNStabError(f"data.class_path={class_path!r} cannot be imported") from None
    kwargs = dict(data.get("init_args") or {})
    if "block_size" in inspect.signature(cls).parameters:
        kwargs["block_size"] = block_size
    dm = cls(**kwargs)
    if not callable(getattr(dm, "validation_tokens", None)):
        raise LNStabError(f"data.class_path={class_path!r} has no validation_tokens(); it must be an lnstab datamodule")
    return dm


def _callback_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    for cb in (cfg.get("trainer") or {}).get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("FinalEvaluation"):
            return dict(cb.get("init_args") or {})
    return {}


def main(argv: list[str]) -> dict[str, Any]:
    """Entry point of ``lnstab evaluate``; prints the metrics and the path written, returns the record."""
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config)
    config = gpt_config(cfg.get("model") or {})
    model, ckpt = load_checked_model(args.ckpt, config)
    # Defaults are evaluate_model's own, for the settings a user may choose (flags, or FinalEvaluation's init_args).
    defaults_of = inspect.signature(evaluate_model).parameters
    settings = {k: defaults_of[k].default for k in SETTINGS}
    defaults = _callback_defaults(cfg)
    settings.update({k: v for k, v in defaults.items() if k in settings})
    settings.update({k: v for k, v in vars(args).items() if k in settings and v is not None})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dm = build_datamodule(cfg.get("data") or {}, config.block_size)
    dm.setup("validate")
    result = evaluate_model(model.to(device), dm.validation_tokens(), rank=0, world_size=1, **settings)
    ckpt_path = Path(args.ckpt).resolve()
    out = Path(args.out) if args.out else (
        ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
    )
    path = write_eval_json(
        out, result, stage="evaluate", checkpoint=str(ckpt_path), config=list(args.config),
        global_step=ckpt.get("global_step"),
    )
    print(json.dumps(result["metrics"], indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return result
