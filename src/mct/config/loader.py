"""The loader: a TOML file, ``--set section.key=value`` text typed by the field (lists and tables
as TOML writes them), the recipes' defaults, and ``load_config`` that puts them together.
Every mistake is a ``ValueError`` naming the key and the value as the user wrote it."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from mct.config.schema import _SECTIONS, EngineConfig, _refused
from mct.config.values import ByteSize, Name


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _parse_bracketed(key: str, text: str, options: tuple[Any, ...]) -> Any:
    """A --set value written as a TOML array or inline table (``[a, b]``, ``["a", "b"]``,
    ``{all = 2, none = 1}``): what TOML makes of it (``EngineConfig.from_dict`` checks its
    type), else bare words as strings (``[all,none]`` -> ['all', 'none']). Raises ValueError
    showing the accepted forms for an unbalanced or malformed one."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    origins = {typing.get_origin(t): t for t in options}
    closing = {"[": "]", "{": "}"}[text[0]]
    if text.endswith(closing) and text[0] == "[" and list in origins:
        item = (typing.get_args(origins[list]) or (str,))[0]
        items = [_unquote(s) for s in text[1:-1].split(",") if s.strip()]
        return [_parse_text(f"{key}[{i}]", s, item) for i, s in enumerate(items)]
    if text.endswith(closing) and text[0] == "{" and dict in origins:
        pairs = [s.split("=", 1) for s in text[1:-1].split(",") if s.strip()]
        if all(len(p) == 2 and p[0].strip() for p in pairs):
            return {_unquote(k): _parse_text(f"{key}.{_unquote(k)}", v.strip(), typing.get_args(origins[dict])[1])
                    for k, v in pairs}
    forms = [f"a list as {key}=[a,b], {key}='[\"a\",\"b\"]' or {key}=a,b"] if list in origins else []
    forms += [f"a table as {key}={{name=N,name=N}} or {key}=name=N,name=N"] if dict in origins else []
    what = " or ".join(w for w, o in (("list", list), ("table", dict)) if o in origins)
    raise ValueError(f"{key} = {text!r} is not a TOML {what}: write {' or '.join(forms)}")


def _parse_text(key: str, text: str, typ: Any) -> Any:
    """Type a --set string by the field's annotation; a list or table key takes the TOML
    form too (``_parse_bracketed``). Raises ValueError naming the key and the value."""
    options = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    if text[:1] in ("[", "{") and any(typing.get_origin(t) in (list, dict) for t in options):
        return _parse_bracketed(key, text, options)
    for t in options:
        if t is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
        elif typing.get_origin(t) is dict:
            if "=" in text:  # name=value,name=value (TOML's {name = value, ...} too)
                pairs = [s.split("=", 1) for s in text.strip().strip("{}").split(",") if s.strip()]
                if all(len(p) == 2 for p in pairs):
                    return {k.strip(): _parse_text(f"{key}.{k.strip()}", v.strip(), typing.get_args(t)[1])
                            for k, v in pairs}
        elif typing.get_origin(t) is list:  # a,b (the bracketed forms above)
            item = (typing.get_args(t) or (str,))[0]
            items = [_unquote(s) for s in text.split(",") if s.strip()]
            return [_parse_text(f"{key}[{i}]", s, item) for i, s in enumerate(items)]
        elif t in (int, float):
            try:
                return t(text)
            except (ValueError, OverflowError):
                continue
        elif t is str or t is ByteSize or (isinstance(t, type) and issubclass(t, Name)):
            return text
    names = " or ".join(getattr(t, "__name__", str(t)) for t in options)
    raise ValueError(f"{key} = {text!r} has the wrong type: expected {names}")


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a config dict, typing each by its field."""
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r} must look like section.key=value, e.g. zero.stage=2")
        path, text = item.split("=", 1)
        path = path.strip()
        if path == "seed":
            d["seed"] = _parse_text("seed", text, int)
            continue
        if path.count(".") != 1:
            raise ValueError(f"--set {item!r}: the key must be section.key, e.g. train.steps=100")
        section, key = path.split(".")
        if section not in _SECTIONS:
            raise ValueError(f"--set {item!r}: unknown section {section!r}; allowed: {', '.join(_SECTIONS)}")
        hints = typing.get_type_hints(_SECTIONS[section])
        if _refused(section, key):
            raise ValueError(f"--set {item!r}: {_refused(section, key)}")
        if key not in {f.name for f in dataclasses.fields(_SECTIONS[section])}:
            raise ValueError(f"--set {item!r}: unknown key {path}; allowed in [{section}]: "
                             f"{', '.join(sorted(f.name for f in dataclasses.fields(_SECTIONS[section])))}")
        if not isinstance(d.setdefault(section, {}), dict):
            raise ValueError(f"config section [{section}] must be a table, got {d[section]!r}; "
                             f"write it as [{section}] with key = value lines")
        d[section][key] = _parse_text(path, text.strip(), hints[key])
    return d


CLI_RECIPE: dict[str, dict[str, Any]] = {"train": {"grad_clip": 1.0}}
"""Defaults of the ``mct`` command's training recipe where they differ from the Python
API's: the CLI clips the global gradient norm at 1.0 (nanoGPT's recipe); ``Engine``
built from ``EngineConfig.from_dict`` does not clip unless told (DeepSpeed, FSDP)."""

FINETUNE_RECIPE: dict[str, dict[str, Any]] = {
    "train": {"lr": 2e-5, "weight_decay": 0.01, "grad_clip": 1.0, "min_lr_ratio": 0.0},
    "optimizer": {"betas": [0.9, 0.999]}}
"""``mct train``'s defaults for a run that starts from pretrained weights (``train.init_from``
set), in place of ``CLI_RECIPE`` and the field defaults: torchtune's and axolotl's full
fine-tune values (lr 2e-5, AdamW's betas and weight decay 0.01, cosine to 0, clip 1.0).
The warm-up is ``FINETUNE_WARMUP_FRACTION`` of ``train.steps`` (``mct.run.recipe``)."""
FINETUNE_WARMUP_FRACTION = 0.03
"""The fine-tune recipe's warm-up: this fraction of ``train.steps`` (HF's ``warmup_ratio``), >= 1 step."""


def _read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML config file. Raises ValueError (one line) for a missing path, a
    directory, a device or FIFO (which would block or read nothing), an unreadable or
    non-UTF-8 file, and invalid TOML."""
    p = Path(path)
    what = f"--config {str(p)!r}"
    if not str(path).strip():  # Path('') is '.', a directory: say what was given
        raise ValueError("--config '' is empty; pass the path of a TOML file")
    if not p.exists():
        raise ValueError(f"{what}: no such file; pass the path of a TOML file")
    if p.is_dir():
        raise ValueError(f"{what} is a directory; pass a TOML file inside it")
    if not p.is_file():
        raise ValueError(f"{what} is not a regular file (a device, FIFO or socket); pass a TOML file")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"{what} cannot be read ({e.strerror or e}); check its permissions") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8 text; pass a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{what} is not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict[str, dict[str, Any]] | None = None) -> EngineConfig:
    """``defaults`` (e.g. ``CLI_RECIPE``) < TOML file (optional) < ``--set`` overrides ->
    validated EngineConfig. Raises ValueError naming the key, the value and the fix."""
    d: dict[str, Any] = {k: dict(v) for k, v in (defaults or {}).items()}
    if path is not None:
        for name, value in _read_config_file(path).items():
            if isinstance(value, dict) and isinstance(d.get(name), dict):
                d[name] = {**d[name], **value}
            else:
                d[name] = value
    return EngineConfig.from_dict(apply_overrides(d, overrides or []))
