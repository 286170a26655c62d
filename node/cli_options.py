"""Build typer options from `NodeConfig`'s fields, so flags and settings share one definition.

Every generated option defaults to None ("not given"), so a flag that is left out does
not override the environment or the YAML file; the help shows the setting's default.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from node.config import NodeConfig


def _flag_type(annotation: Any) -> Any:
    """The type typer parses a flag into; pydantic does the real validation afterwards."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _flag_type(args[0])
    if origin is list:
        return list[str]
    if origin is Literal:
        return str
    if annotation in (int, float, bool, str, Path):
        return annotation
    return str


def _help(field: FieldInfo) -> str:
    text = field.description or ""
    if field.default_factory is None and field.default is not None and "[default" not in text:
        default = field.default
        text += f" [default: {str(default).lower() if isinstance(default, bool) else default}]"
    return text


def _flag_names(name: str, flag_type: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if flag_type is bool:
        return [f"{flag}/--no-{flag[2:]}"]
    return [flag]


def with_config_options(
    exclude: set[str] = frozenset(),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate `fn(config: NodeConfig, **own_options)`: adds one option per setting plus
    `--config FILE`, and calls `fn` with the merged `NodeConfig`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn)  # real types: annotations may be strings here
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(fn).parameters.values()
            if p.name != "config"
        ]
        fields = {n: f for n, f in NodeConfig.model_fields.items() if n not in exclude}
        params = list(own)
        params.append(
            inspect.Parameter(
                "config_file",
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(None, "--config", help="YAML file with settings (keys as the flags, with _)."),
                annotation=Path | None,
            )
        )
        for name, field in fields.items():
            flag_type = _flag_type(field.annotation)
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(None, *_flag_names(name, flag_type), help=_help(field), show_default=False),
                    annotation=flag_type | None,
                )
            )

        def wrapper(**kwargs: Any) -> Any:
            own_kwargs = {p.name: kwargs.pop(p.name) for p in own}
            config_file = kwargs.pop("config_file")
            # typer gives [] for a repeatable flag that was not passed: treat it as "not given".
            overrides = {k: (None if v == [] else v) for k, v in kwargs.items()}
            try:
                config = NodeConfig.load(config_file, **overrides)
            except (ValidationError, FileNotFoundError) as err:
                raise typer.BadParameter(_readable(err)) from None
            return fn(config=config, **own_kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return decorate


def _readable(err: Exception) -> str:
    """One line per bad setting, naming the flag the user should fix."""
    if not isinstance(err, ValidationError):
        return str(err)
    lines = []
    for e in err.errors():
        flag = "--" + "-".join(str(p) for p in e["loc"]).replace("_", "-") if e["loc"] else "settings"
        lines.append(f"{flag}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)
