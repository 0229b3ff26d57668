"""Generic machinery behind ``JobConfig``: TOML + ``--section.key value`` parsing, type checks, ``--help``.

Nothing here knows the concrete sections. A config class is a dataclass whose fields are section
dataclasses; each section field is a scalar (``int``, ``float``, ``str``, ``bool``), a ``Literal``,
a ``list[...]``, or a union of those (``X | None``, ``Literal["auto"] | bool``). Adding a section is
therefore just adding a dataclass and a field of the config class. Field docstrings are the string
literals written directly below each field; they are read back from the source (``ast``) for
``--help`` so documentation lives in exactly one place.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import sys
import textwrap
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")  # TOML has no null, so only the command line can unset an optional field
_SPECIAL_OPTIONS = ("config", "help", "print-config")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key and how to fix it."""


def check(ok: bool, name: str, problem: str) -> None:
    """Raise ConfigError('<name>: <problem>') unless ``ok``: the one shape of every range check."""
    if not ok:
        raise ConfigError(f"{name}: {problem}")


class _Mismatch(Exception):
    """Internal: a value does not fit a type (turned into a ConfigError with context by ``convert``)."""


def did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest candidate, or ``""`` when nothing is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


# ---------------------------------------------------------------------------------------------
# Introspection


def sections(config_cls: type) -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)
            if dataclasses.is_dataclass(hints[f.name])}


def section_fields(section_cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of one section, in declaration order."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls) if f.init}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written directly below the field in the source of ``cls`` or a base class.

    A generated class (``dataclasses.make_dataclass``: no source of its own) carries its docs as a
    ``__field_docs__`` dict instead.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # bases first: a subclass's doc wins
        if "__field_docs__" in vars(klass):
            docs.update(klass.__field_docs__)
        elif dataclasses.is_dataclass(klass):
            docs.update(_source_field_docs(klass))
    return docs


def _source_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped (e.g. a zipapp of .pyc files): help without docs
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _is_union(tp: Any) -> bool:
    return get_origin(tp) is Union or get_origin(tp) is types.UnionType


def describe(tp: Any) -> str:
    """Human-readable type, e.g. ``int``, ``'torch' | 'reference' | none``, ``list[float]``."""
    if tp is type(None):
        return "none"
    if _is_union(tp):
        return " | ".join(describe(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in get_args(tp))
    if get_origin(tp) in (list, tuple):
        return f"list[{describe(get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _choices(tp: Any) -> list[str]:
    """All Literal choices reachable in ``tp`` (for did-you-mean on a misspelt choice)."""
    if get_origin(tp) is Literal:
        return [str(c) for c in get_args(tp)]
    if _is_union(tp):
        return [c for a in get_args(tp) for c in _choices(a)]
    return []


def _accepts_bool(tp: Any) -> bool:
    return tp is bool or (_is_union(tp) and any(_accepts_bool(a) for a in get_args(tp)))


# ---------------------------------------------------------------------------------------------
# Values


def _convert(value: Any, tp: Any, from_cli: bool) -> Any:
    """``value`` as ``tp``. Command-line values arrive as strings; TOML values are already typed."""
    cli_str = from_cli and isinstance(value, str)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None or (cli_str and value.lower() in _NONE):
            return None
        raise _Mismatch
    if _is_union(tp):
        # None first, so that "--data.path none" unsets instead of meaning a file called "none".
        arms = sorted(get_args(tp), key=lambda a: a is not type(None))
        for arm in arms:
            try:
                return _convert(value, arm, from_cli)
            except _Mismatch:
                pass
        raise _Mismatch
    origin = get_origin(tp)
    if origin is Literal:
        for choice in get_args(tp):
            if type(value) is type(choice) and value == choice:
                return choice
            if cli_str and not isinstance(choice, str):
                try:
                    if _convert(value, type(choice), True) == choice:
                        return choice
                except _Mismatch:
                    pass
        raise _Mismatch
    if origin in (list, tuple):
        elem = get_args(tp)[0] if get_args(tp) else Any
        if cli_str:
            text = value.strip()
            if text.startswith("["):  # TOML array syntax: [0.9, 0.95]
                try:
                    value, from_cli = tomllib.loads(f"v = {text}")["v"], False
                except tomllib.TOMLDecodeError:
                    raise _Mismatch from None
            else:  # comma-separated: 0.9,0.95
                value = [part.strip() for part in text.split(",")] if text else []
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_convert(v, elem, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if cli_str and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if cli_str:
            try:
                return int(value)
            except ValueError:
                pass
            try:  # accept 1e3 / 1000.0 on the command line, but never silently truncate 2.5
                as_float = float(value)
            except ValueError:
                raise _Mismatch from None
            if as_float.is_integer():
                return int(as_float)
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if cli_str:
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"config field type {tp!r} is not supported by nsa_titan.config")


def convert(value: Any, tp: Any, name: str, from_cli: bool) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming ``name``, the expected type and a suggestion."""
    try:
        return _convert(value, tp, from_cli)
    except _Mismatch:
        hint = did_you_mean(value, _choices(tp)) if isinstance(value, str) else ""
        raise ConfigError(f"{name}: invalid value {value!r}; expected {describe(tp)}{hint}") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr gives TOML-valid floats: 0.1, 1e-08, inf, nan
    if isinstance(value, str):
        # JSON escapes are valid TOML basic-string escapes; DEL is the one control char JSON leaves raw.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_dict(cfg: Any) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` of a config instance (for logging / JSON)."""
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: Any) -> str:
    """The resolved config as a TOML document that loads back to the same values."""
    lines = []
    for name, values in config_to_dict(cfg).items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            # TOML has no null: an unset optional field is written as a comment (= keep the default).
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Help


def format_help(config_cls: type, prog: str = "python -m nsa_titan.train") -> str:
    """Every field of every section, with type, default and docstring."""
    out = [
        f"usage: {prog} [--config FILE] [--section.key VALUE ...] [--print-config] [--help]",
        "",
        "Settings come from the dataclass defaults, then the TOML file given by --config, then the",
        "command line (command line wins). Write overrides as `--section.key value` or",
        "`--section.key=value`. A bare `--section.flag` sets a boolean true (`--section.flag false`",
        "clears it); lists take `0.9,0.95` or `[0.9, 0.95]`; `none` unsets an optional field.",
        "--print-config prints the resolved config as TOML and exits.",
    ]
    for name, section_cls in sections(config_cls).items():
        summary = (inspect.getdoc(section_cls) or "").split("\n")[0]
        out += ["", f"[{name}]" + (f"  {summary}" if summary else "")]
        docs = field_docs(section_cls)
        defaults = section_cls()
        for key, tp in section_fields(section_cls).items():
            default = getattr(defaults, key)
            out.append(f"  --{name}.{key}  ({describe(tp)}, default: {default!r})")
            for line in docs.get(key, "").splitlines():
                out.append(f"      {line}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Loading


def _field_type(config_cls: type, section: str, key: str, where: str) -> Any:
    """Type of ``section.key``; unknown names raise a ConfigError with a suggestion."""
    secs = sections(config_cls)
    if section not in secs:
        raise ConfigError(f"{where}unknown section {section!r}{did_you_mean(section, secs)}; "
                          f"valid sections: {', '.join(secs)}")
    fields = section_fields(secs[section])
    if key not in fields:
        # The right key in the wrong section (--model.seq_len) beats a near spelling in this one.
        homes = [s for s in secs if key in section_fields(secs[s])]
        hint = f" (did you mean '{homes[0]}.{key}'?)" if homes else did_you_mean(key, fields)
        raise ConfigError(f"{where}unknown key '{section}.{key}'{hint}; "
                          f"valid keys of [{section}]: {', '.join(fields)}")
    return fields[key]


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r} (given by --config / job.config_file)") from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 TOML ({e.reason})") from None
    except tomllib.TOMLDecodeError as e:  # the message carries "(at line N, column M)"
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None


def _apply_toml(cfg: Any, path: str) -> None:
    for section, table in _read_toml(path).items():
        if not isinstance(table, dict):
            secs = sections(type(cfg))
            if section in secs:
                raise ConfigError(f"{path}: {section!r} must be a table: write [{section}] and its keys below")
            raise ConfigError(f"{path}: top-level key {section!r}: settings must live in a [section]; "
                              f"valid sections: {', '.join(secs)}")
        for key, value in table.items():
            tp = _field_type(type(cfg), section, key, f"{path}: ")
            setattr(getattr(cfg, section), key, convert(value, tp, f"{path}: {section}.{key}", False))


def _parse_argv(config_cls: type, argv: list[str], config_file_key: str):
    """(overrides [(section, key, raw)], help?, print?) from argv; raises on unknown names."""
    overrides, want_help, want_print = [], False, False
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok in ("-h", "--help"):
            want_help = True
            continue
        if tok == "--print-config":
            want_print = True
            continue
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: overrides look like --section.key value")
        name, eq, raw = tok[2:].partition("=")
        if name == "config":
            name = config_file_key
        section, dot, key = name.partition(".")
        if not dot:
            known = list(_SPECIAL_OPTIONS) + [f"{s}.{k}" for s, c in sections(config_cls).items()
                                                for k in section_fields(c)]
            raise ConfigError(f"unknown option --{name}{did_you_mean(name, known)}; "
                              "options are --config FILE, --help, --print-config and --section.key VALUE")
        tp = _field_type(config_cls, section, key, f"--{name}: ")
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            takes_next = nxt is not None and not nxt.startswith("--")
            if _accepts_bool(tp):
                # A bare flag means true. No positional arguments exist, so a non-option token after
                # a flag can only be meant as its value: convert() reports it if it is not one.
                raw = nxt if takes_next else "true"
            elif takes_next:
                raw = nxt
            else:
                raise ConfigError(f"--{name} needs a value ({describe(tp)})")
            i += 1 if takes_next else 0
        overrides.append((section, key, raw))
    return overrides, want_help, want_print


def parse_config(config_cls: type, argv: list[str], *, config_file_key: str = "job.config_file",
                 prog: str = "python -m nsa_titan.train", validate_kwargs: dict[str, Any] | None = None) -> Any:
    """Build ``config_cls`` from defaults, the TOML file named on the command line, then overrides.

    ``--help`` prints :func:`format_help` and ``--print-config`` the resolved TOML; both exit 0.
    Calls ``cfg.validate(**validate_kwargs)`` when the config class defines it.
    """
    if "-h" in argv or "--help" in argv:  # help wins even over otherwise broken arguments
        print(format_help(config_cls, prog), end="")
        raise SystemExit(0)
    overrides, _, want_print = _parse_argv(config_cls, argv, config_file_key)
    cfg = config_cls()
    file_section, file_key = config_file_key.split(".")
    config_files = [raw for s, k, raw in overrides if (s, k) == (file_section, file_key)]
    if config_files and config_files[-1]:
        _apply_toml(cfg, config_files[-1])
    for section, key, raw in overrides:  # in order: a later repeat wins
        tp = _field_type(config_cls, section, key, "")
        setattr(getattr(cfg, section), key, convert(raw, tp, f"--{section}.{key}", True))
    if hasattr(cfg, "validate"):
        cfg.validate(**(validate_kwargs or {}))
    if want_print:
        print(config_to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg
