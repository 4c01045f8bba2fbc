"""One settings path for every dflash command: a dataclass gives the flags, the config keys and --help.

A command's settings are one `kw_only` dataclass; each field is one setting:

- its name is the config-file key and, with dashes, the flag (`max_seq_len` <-> `--max-seq-len`);
- the string literal under it is its `--help` text;
- its annotation gives the flag's type: `bool` a `--x/--no-x` switch, `int`, `float`, `str`,
  `list[X]` a repeatable flag, `tuple[float, float]` a flag of two values, `X | None` a setting
  whose default is decided later;
- `setting(...)` adds what the annotation cannot say: the choices, a click type (a path that must
  exist, a dtype), another flag spelling, a one-way flag (`--force`), a hidden flag, and what the
  setting means to a resume (`identity=`): a setting so marked is part of the identity a resumed
  run or cache must match (`identity_of` builds it from the marks); one not marked may change
  between a run and its resume;
- a field whose type is a dataclass decorated with `@section` is a group of settings: its fields
  are flags and keys of their own, flat (`lr`, not `optimization.lr`);
- `compose(...)` makes one settings class of the dataclasses several components declare beside
  their code (each drafter head's settings, train/heads/), their fields in the parts' order.

`settings_options(cls)` decorates a click command function with one option per setting and
`--config FILE`; the function receives the built settings (`settings=`). Where a value comes
from: a flag given on the command line, else the config file, else the field's default. Both
go through the same conversion: a config-file value is converted by the click type of its flag,
as the flag's text would be, so `"token_budget": "big"` is refused like `--token-budget big`,
a string for a switch means what click makes of it (`"false"`, `"no"`, `"off"`, `"0"` are
false; anything but those and their true counterparts is refused), and `1000.7` for an integer
is refused (an integral `1000.0` is 1000). A setting of text (annotated `str`: a path, a name, a
choice) takes only text from a file: YAML reads an unquoted `0755` as the integer 493 and `on` as
true, and turning those back into text would run with a value the user never wrote, so any other
value is refused with the fix, to quote it (a setting that also means something by a number says
so in its annotation: `str | int`). A key that names no setting is refused with the list
of the known ones (`dflash.runtime.config.read_config_file`). Range and consistency checks are
the dataclass's own (`__post_init__`): they see one object, wherever its values came from.

Importing this module does not import torch, so that `--help` stays fast.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import textwrap
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

import click
from click.core import ParameterSource

from .config import config_key, read_config_file, yaml_source
from .errors import DflashError, SettingError
from .findings import Finding, emit

GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
_SECTION = "__dflash_section__"
_META = "dflash_setting"


def section(cls: type) -> type:
    """Mark a dataclass as a group of settings inside a command's settings (flattened)."""
    setattr(cls, _SECTION, True)
    return cls


@dataclass(frozen=True)
class Identity:
    """Where a setting enters the identity a resume must match (`setting(identity=...)`)."""

    group: str | None = None
    """The part of the identity it sits in (None: the top level)."""
    key: str | None = None
    """Its name there (default: the setting's)."""
    source: str | None = None
    """The attribute its value is read from, where the identity records a value the run resolved
    rather than the setting as given (default: the key): of the object `identity_of` is given for
    the group, else of the settings' own section (a property of it)."""
    omit_default: bool = False
    """Left out at its default: a setting added after identities were first recorded without it,
    so that those still match."""


@dataclass(frozen=True)
class SettingSpec:
    """What a field's annotation cannot say about its flag (`setting(...)`)."""

    choices: Sequence[str] | None = None
    """The names the setting takes (shown in --help, checked for flags and config values alike)."""
    type: click.ParamType | None = None
    """A click type for the flag and the config value (e.g. click.Path(exists=True))."""
    flag: str | None = None
    """Another spelling of the flag (`--prompts` for field `prompt_files`); its name is also a key."""
    one_way: bool = False
    """A boolean given as `--x` alone (no `--no-x`)."""
    secondary: str | None = None
    """The off-spelling of a switch, when not `--no-x` (`--keep-truncated`)."""
    hidden: bool = False
    """Left out of --help (e.g. a deprecated spelling)."""
    metavar: str | None = None
    identity: Identity | None = None
    """Part of the identity a resume must match (None: it may change on resume)."""


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, identity: Identity | str | bool | None = None,
            **spec: Any) -> Any:
    """A dataclass field with `SettingSpec` metadata: `x: int = setting(4, choices=...)`.
    `identity=True` (top level), a group's name or an `Identity` marks it part of the identity a
    resume must match."""
    if identity is True or isinstance(identity, str):
        identity = Identity(group=None if identity is True else identity)
    kwargs: dict[str, Any] = {"metadata": {_META: SettingSpec(identity=identity or None, **spec)}}
    if default_factory is not MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


class IntList(click.ParamType):
    """Comma-separated integers (`1,9,17`) as a flag; a list of integers or that text in a file."""

    name = "INTS"
    accepts_list = True

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
        try:
            return [int(x) for x in str(value).replace(" ", "").split(",") if x]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 1,9,17)", param, ctx)


class JsonObject(click.ParamType):
    """A JSON object: text on the command line, a mapping (or that text) in a config file."""

    name = "JSON"
    accepts_mapping = True

    def convert(self, value: Any, param: Any, ctx: Any) -> dict:
        if isinstance(value, dict):
            return value
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"{value!r} is not valid JSON ({e.msg}); write e.g. '{{\"enable_thinking\": false}}'", param, ctx)
        if not isinstance(obj, dict):
            self.fail(f"{value!r} is not a JSON object; write e.g. '{{\"enable_thinking\": false}}'", param, ctx)
        return obj


# -- the settings of a class ------------------------------------------------------------------


def compose(name: str, parts: Sequence[type], *, module: str, doc: str,
            error: type[Exception] = SettingError) -> type:
    """One kw_only settings dataclass named `name` (of `module`) whose fields are those of the
    dataclasses `parts`, in their order: a command's settings made of components that each declare
    theirs beside their code (the drafter heads', train/heads/). Its `__post_init__` runs, part by
    part, the part's own `__post_init__` and its limits, `refusal(self) -> Finding | None` (the
    first setting of the part out of its range), raised as the class's `settings_error` (`error`;
    a subclass may set another). A subclass that has a `__post_init__` calls `super().__post_init__()`."""
    hooks = [(part.__dict__.get("__post_init__"), part.__dict__.get("refusal")) for part in parts]

    def __post_init__(self: Any) -> None:
        for own, refusal in hooks:
            if own is not None:
                own(self)
            found = refusal(self) if refusal is not None else None
            if found is not None:
                raise type(self).settings_error(found)

    namespace = {"__module__": module, "__qualname__": name, "__doc__": doc, "__annotations__": {},
                 "__post_init__": __post_init__, "settings_error": error}
    # the dataclass takes its bases' fields from the last base to the first: the parts reversed
    return dataclass(kw_only=True)(type(name, tuple(reversed(parts)), namespace))


@dataclass
class Setting:
    """One setting: its field, the section it sits in, its click option."""

    name: str
    section: str | None
    field: dataclasses.Field
    option: click.Option
    optional: bool
    kind: str  # "bool", "list", "tuple", "scalar"
    text: bool = False
    """Its values are text (annotated `str`, or a list of `str`): a config file must give it strings."""

    @property
    def flag(self) -> str:
        return next(o for o in self.option.opts if o.startswith("--"))

    @property
    def spec(self) -> SettingSpec:
        return self.field.metadata.get(_META, SettingSpec())

    def default(self) -> Any:
        f = self.field
        if f.default is not MISSING:
            return f.default
        if f.default_factory is not MISSING:  # type: ignore[misc]
            return f.default_factory()  # type: ignore[misc]
        return MISSING


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of `cls` and its bases (they are the --help texts)."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                out[node.target.id] = " ".join(str(nxt.value.value).split())
    return tuple(out.items())


def _default_text(value: Any, kind: str) -> str:
    if kind == "bool":
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value)


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(X, optional) of an annotation X or X | None."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return hint, False


class FiniteFloat(click.ParamType):
    """A float setting: nan and inf are refused, as no setting means anything by them (a range
    check lets nan through: any comparison with it is false)."""

    name = "float"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()


def _click_type(kind: Any, spec: SettingSpec) -> click.ParamType:
    if spec.type is not None:
        return spec.type
    if spec.choices is not None:
        return click.Choice(list(spec.choices))
    return {int: click.INT, float: FINITE_FLOAT, str: click.STRING}.get(kind, click.STRING)


def _make_setting(f: dataclasses.Field, hint: Any, section_name: str | None, doc: str) -> Setting:
    spec: SettingSpec = f.metadata.get(_META, SettingSpec())
    kind, optional = _base_type(hint)
    flag = spec.flag or f"--{f.name.replace('_', '-')}"
    help_text = doc
    shell = Setting(f.name, section_name, f, None, optional, "scalar")  # type: ignore[arg-type]
    default = shell.default()
    origin = typing.get_origin(kind)
    shell.text = kind is str or (origin in (list, tuple) and set(typing.get_args(kind)) <= {str, Ellipsis})
    common: dict[str, Any] = {"hidden": spec.hidden, "metavar": spec.metavar, "show_default": False}
    if kind is bool:
        shell.kind = "bool"
        decl = flag if spec.one_way else f"{flag}/{spec.secondary or '--no-' + flag[2:]}"
        option = click.Option([decl, f.name], is_flag=True, default=None, **common)
    elif getattr(spec.type, "accepts_list", False):
        option = click.Option([flag, f.name], type=spec.type, default=None, **common)
    elif origin in (list, tuple) and (origin is list or typing.get_args(kind)[-1] is Ellipsis):
        shell.kind = "list"
        option = click.Option([flag, f.name], multiple=True, type=_click_type(typing.get_args(kind)[0], spec),
                              default=None, **common)
    elif origin is tuple:
        shell.kind = "tuple"
        items = typing.get_args(kind)
        option = click.Option([flag, f.name], nargs=len(items), type=_click_type(items[0], spec), default=None,
                              **common)
    else:
        option = click.Option([flag, f.name], type=_click_type(kind, spec), default=None, **common)
    quiet = spec.hidden or (spec.one_way and not default)  # `--force`: off unless given
    if default is not MISSING and default is not None and default not in ([], (), "", {}) and not quiet:
        help_text += f"  [default: {_default_text(default, shell.kind)}]"
    elif default is MISSING:
        help_text += "  [required]"
    option.help = help_text
    shell.option = option
    return shell


def settings_of(cls: type) -> dict[str, Setting]:
    """{name: Setting} of every field of `cls`, sections flattened, in declaration order."""
    return dict(_settings_of(cls))


@functools.cache
def _settings_of(cls: type) -> tuple[tuple[str, Setting], ...]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[tuple[str, Setting]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and getattr(hint, _SECTION, False):
            inner_hints = typing.get_type_hints(hint)
            inner_docs = field_docs(hint)
            for g in dataclasses.fields(hint):
                out.append((g.name, _make_setting(g, inner_hints[g.name], f.name, inner_docs.get(g.name, ""))))
            continue
        out.append((f.name, _make_setting(f, hint, None, docs.get(f.name, ""))))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: a setting is declared twice: {sorted(n for n in names if names.count(n) > 1)}")
    return tuple(out)


def config_keys(settings: Mapping[str, Setting]) -> dict[str, str]:
    """{config key: setting name}: every setting's name, and its flag's name where that differs."""
    out: dict[str, str] = {}
    for name, s in settings.items():
        out[name] = name
        out.setdefault(config_key(s.flag), name)
    return out


# -- values -----------------------------------------------------------------------------------


def _fail(where: str, s: Setting, value: Any, why: str, error: type[DflashError]) -> DflashError:
    return error(Finding("runtime.setting-invalid", file=where, key=s.name, flag=s.flag, value=value,
                         reason=why.rstrip(".")))


def _not_text(where: str, s: Setting, value: Any, index: int | None, error: type[DflashError]) -> DflashError:
    """A value of another type for a setting of text: refused with its fix, never turned into text
    (YAML's unquoted 0755 would become the path "493")."""
    choices = getattr(s.option.type, "choices", None)
    written = yaml_source(where, {s.name, config_key(s.flag)}, index)
    return error(Finding("runtime.setting-not-text", file=where, line=written[1] if written else None,
                         key=s.name, flag=s.flag, value=value, item=None if index is None else index + 1,
                         written=written[0] if written else None, choices=list(choices) if choices else None))


def _convert_one(s: Setting, value: Any, where: str, error: type[DflashError], index: int | None = None) -> Any:
    """One config-file value through the click type of its flag, as the flag's text would go."""
    param_type = s.option.type
    if s.text and not isinstance(value, (str, Mapping, list, tuple)):
        raise _not_text(where, s, value, index, error)
    if s.kind == "bool":
        if isinstance(value, bool):
            return value
        if not isinstance(value, str) or not value.strip():
            raise _fail(where, s, value, "expected true or false", error)
        param_type = click.BOOL
    elif isinstance(value, Mapping):
        if not getattr(param_type, "accepts_mapping", False):
            raise _fail(where, s, value, "expected a single value, not a mapping", error)
    elif isinstance(value, (list, tuple)):
        if not getattr(param_type, "accepts_list", False):
            raise _fail(where, s, value, "expected a single value, not a list", error)
        value = list(value)
    elif isinstance(value, bool):
        raise _fail(where, s, value, f"expected {param_type.name}, not a boolean", error)
    elif isinstance(value, float) and (param_type is click.INT or isinstance(param_type, click.IntRange)):
        if not value.is_integer():
            raise _fail(where, s, value, "expected an integer, and this one would be truncated", error)
        value = int(value)
    if isinstance(value, (int, float)):
        value = str(value)  # the flag's text
    try:
        return param_type.convert(value, s.option, None)
    except click.BadParameter as e:
        raise _fail(where, s, value, e.message, error) from None


def convert_file_value(s: Setting, value: Any, where: str, error: type[DflashError] = SettingError) -> Any:
    """A config-file value of setting `s`, converted and checked as its flag's would be."""
    if value is None:
        if s.optional:
            return None
        if s.kind == "list":
            return []
        raise _fail(where, s, value, "null is not a value of this setting", error)
    if s.kind == "list":
        if not isinstance(value, (list, tuple)):
            return [_convert_one(s, value, where, error)]
        return [_convert_one(s, v, where, error, index) for index, v in enumerate(value)]
    if s.kind == "tuple":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != s.option.nargs:
            raise _fail(where, s, value, f"expected {s.option.nargs} values", error)
        return tuple(_convert_one(s, v, where, error) for v in items)
    return _convert_one(s, value, where, error)


def read_settings_file(
    settings: Mapping[str, Setting], path: str | os.PathLike, *, deprecated: Mapping[str, str] | None = None,
    error: type[DflashError] = SettingError,
) -> dict[str, Any]:
    """{setting: converted value} of a JSON/YAML config file; unknown keys and bad values refused."""
    keys = config_keys(settings)
    raw = read_config_file(path, keys, error, aliases=deprecated, listed=list(settings))
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in raw.items():
        name = keys[key]
        if name in values:  # the spelling that is not the setting's own name
            raise error(Finding("runtime.config-key-twice", file=str(path), key=name,
                                spelling=spelled[name] if key == name else key))
        values[name], spelled[name] = convert_file_value(settings[name], value, str(path), error), key
    return values


def given_flags(ctx: click.Context, flags: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """The settings given on the command line (or by environment), lists as lists."""
    settings = settings_of(cls)
    out: dict[str, Any] = {}
    for name, value in flags.items():
        if name in settings and ctx.get_parameter_source(name) in GIVEN:
            out[name] = list(value) if settings[name].kind == "list" else value
    return out


def build_settings(cls: type, values: Mapping[str, Any], *, error: type[DflashError] = SettingError) -> Any:
    """`cls` from {setting: value} (sections nested again); missing required settings named."""
    settings = settings_of(cls)
    missing = [s.flag for n, s in settings.items() if s.default() is MISSING and values.get(n) in (None, "", [])]
    if missing:
        raise error(Finding("runtime.setting-missing", flags=missing))
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        where = settings[name].section
        if where is None:
            top[name] = value
        else:
            sections.setdefault(where, {})[name] = value
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in sections or (isinstance(hints[f.name], type) and getattr(hints[f.name], _SECTION, False)):
            top[f.name] = hints[f.name](**sections.get(f.name, {}))
    return cls(**top)


def flat_values(obj: Any) -> dict[str, Any]:
    """{setting: value} of a settings object, sections flattened (the shape of a config file)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and getattr(type(value), _SECTION, False):
            out.update(flat_values(value))
        else:
            out[f.name] = value
    return out


def identity_of(obj: Any, *, resolved: Mapping[str, Any] | None = None,
                values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity a resume must match, of the settings of `obj` marked `identity=`: {key: value}
    at the top level and {group: {key: value}} in groups, in declaration order, tuples as lists
    (as JSON keeps them). `resolved` gives per group an object holding the values as the run
    resolved them (a drafter's config for its shape), read by each setting's `source` or key;
    `values` gives a setting's value by its name where the caller decides it."""
    resolved, values = resolved or {}, values or {}
    out: dict[str, Any] = {}
    for name, s in settings_of(type(obj)).items():
        mark = s.spec.identity
        if mark is None:
            continue
        key = mark.key or name
        if name in values:
            value = values[name]
        elif mark.group in resolved:
            value = getattr(resolved[mark.group], mark.source or key)
        else:
            value = getattr(getattr(obj, s.section) if s.section else obj, mark.source or name)
        if mark.omit_default and value == s.default():
            continue
        (out.setdefault(mark.group, {}) if mark.group else out)[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- the click side ---------------------------------------------------------------------------


def _add_param(f: Callable, param: click.Parameter) -> None:
    if not hasattr(f, "__click_params__"):
        f.__click_params__ = []  # type: ignore[attr-defined]
    f.__click_params__.append(param)  # type: ignore[attr-defined]


def settings_options(
    cls: type, *, config: bool = True, only: Sequence[str] | None = None, build: bool = True,
    deprecated: Mapping[str, str] | None = None, config_help: str | None = None,
    help_overrides: Mapping[str, str] | None = None, error: type[DflashError] = SettingError,
) -> Callable[[Callable], Callable]:
    """Decorate a click command function with `cls`'s settings as flags (and `--config FILE`).

    The function is called with `settings=` the built `cls` (flags over the file over the
    defaults) and the command's other parameters. `only` takes a subset of the settings and
    `build=False` passes {setting: value} of the given ones instead of an object (for a
    command that hands them on). `deprecated` maps old names to settings: a hidden flag and a
    config key, each accepted with a warning.
    """
    chosen = {n: s for n, s in settings_of(cls).items() if only is None or n in only}
    deprecated = dict(deprecated or {})

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(**kwargs: Any) -> Any:
            ctx = click.get_current_context()
            path = kwargs.pop("config_file", None) if config else None
            flags = {n: kwargs.pop(n) for n in list(kwargs) if n in chosen or n in deprecated}
            values = read_settings_file(chosen, path, deprecated=deprecated, error=error) if path else {}
            for old, new in deprecated.items():
                if ctx.get_parameter_source(old) in GIVEN:
                    if ctx.get_parameter_source(new) in GIVEN:
                        raise error(Finding("runtime.flag-deprecated-and-new", flag=f"--{old.replace('_', '-')}",
                                            now=chosen[new].flag))
                    emit(Finding("runtime.flag-deprecated", flag=f"--{old.replace('_', '-')}", now=chosen[new].flag),
                         prefix="Warning: ")
                    values[new] = flags[old]
            values.update(given_flags(ctx, flags, cls))
            if build:
                try:
                    kwargs["settings"] = build_settings(cls, values, error=error)
                except TypeError as e:
                    raise error(Finding("runtime.settings-invalid", error=str(e))) from e
            else:
                kwargs["settings"] = values
            return f(**kwargs)

        for old, new in reversed(list(deprecated.items())):
            old_option = chosen[new].option
            _add_param(command, click.Option([f"--{old.replace('_', '-')}", old], type=old_option.type,
                                             hidden=True, default=None))
        for s in reversed(list(chosen.values())):
            option = s.option
            if help_overrides and s.name in help_overrides:
                option = _copy_option(option, help_overrides[s.name])
            _add_param(command, option)
        if config:
            _add_param(command, click.Option(
                ["--config", "config_file"], type=click.Path(dir_okay=False), default=None,
                help=config_help or "JSON or YAML file of settings: keys as the flags (with - or _), values as "
                                    "the flags take them; flags given override it."))
        return command

    return decorate


def _copy_option(option: click.Option, help_text: str) -> click.Option:
    import copy

    out = copy.copy(option)
    out.help = help_text
    return out
