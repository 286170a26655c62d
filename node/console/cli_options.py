"""Build typer options from `NodeConfig`'s fields, so flags and settings share one definition.

Every generated option defaults to None ("not given"), so a flag that is left out does
not override the environment or the YAML file. The help of each option shows the
setting's default, its choices, and the environment variable and YAML key that set it too.
"""

from __future__ import annotations

import inspect
import shutil
import textwrap
import types
import typing
from collections.abc import Callable, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from pydantic.fields import FieldInfo
from rich.markup import escape
from typer import Abort

from node.config import NodeConfig, SettingsError, env_name

if TYPE_CHECKING:  # the installed typer's copy of click, as the first branch below takes it
    from typer._click.exceptions import ClickException, UsageError
else:
    try:  # newer typers carry their own copy of click; older ones use click itself
        from typer._click.exceptions import ClickException, UsageError
    except ImportError:  # pragma: no cover
        from click.exceptions import ClickException, UsageError

__all__ = ["Abort", "ClickException", "CliError", "UsageError", "shown_default", "with_config_options"]

# Help panels, in the order of NodeConfig's sections (the first field of each opens it).
PANELS = {
    "name": "Identity and storage",
    "model": "Model, task and engine",
    "rounds": "The round and sampling",
    "loss": "The loss",
    "swarm": "The swarm",
    "api_host": "Status API",
}


#: The settings `-h` shows; the rest are listed by `--help-all` (join -h fits on two screens).
COMMON = frozenset(
    {"name", "data_dir", "model", "task", "train_mode", "lr", "threads", "rounds", "loss", "swarm", "port", "api_port"}
)


def _help_all(ctx: typer.Context, value: bool) -> None:
    """`--help-all`: the help with every setting, the rare ones included."""
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        # typer's TyperOption and TyperArgument have `hidden`; click's Parameter, their annotated base, does not
        param.hidden = False  # type: ignore[attr-defined]
    typer.echo(plain_help(ctx, shutil.get_terminal_size().columns))
    raise typer.Exit()


def plain_help(ctx: typer.Context, columns: int) -> str:
    """Every option by panel, its flags on one line and its help wrapped below them: at any
    width nothing is cut (rich's tables shorten a long default or flag to fit a column)."""
    width = max(40, min(columns, 100))

    def wrapped(text: str, indent: str) -> list[str]:
        return textwrap.wrap(
            text, width, initial_indent=indent, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )

    lines = [f"Usage: {ctx.command_path} [OPTIONS]", ""]
    for paragraph in inspect.cleandoc(ctx.command.help or "").split("\n\n"):
        lines += [*wrapped(" ".join(paragraph.split()), ""), ""]
    panels: dict[str, list[str]] = {}
    for param in ctx.command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        flags, help_text = record
        entry = panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", [])
        entry += [f"  {flags}", *wrapped(help_text.replace("\\[", "["), " " * 6)]
    for panel, entries in panels.items():
        lines += [panel, *entries, ""]
    return "\n".join(lines).rstrip() + "\n"


class CliError(ClickException):
    """A user's mistake: printed as one `error:` line, exit code 2."""

    exit_code = 2


def fail(message: str, code: int = 2) -> None:
    """Stop the command with one `error: message` line and exit code `code`."""
    err = CliError(message)
    err.exit_code = code
    raise err


def _choices(annotation: Any) -> tuple[str, ...]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _choices(args[0])
    return tuple(map(str, args)) if origin is Literal else ()


def _flag_type(annotation: Any) -> Any:
    """The type typer parses a flag into; pydantic does the real validation afterwards."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _flag_type(args[0])
    if origin is typing.Annotated:
        return _flag_type(args[0])
    if origin is list:
        return list[str]
    if annotation in (int, float, bool, str, Path):
        return annotation
    return str


def default_text(field: FieldInfo) -> str | None:
    """What `[default: ...]` shows for a setting (None: nothing to show)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("default_text"):
        return str(extra["default_text"])
    if field.default_factory is not None or field.default is None:
        return None
    default = field.default
    return str(default).lower() if isinstance(default, bool) else str(default)


def shown_default(text: str, default: object) -> str:
    """Help text with its default, escaped so that rich keeps it (for options whose typer
    default is None because the real one is chosen later)."""
    return text + escape(f" [default: {default}]")


def option_help(name: str, field: FieldInfo) -> str:
    """Description, where else the setting can be given, and its default (escaped: typer
    renders help as rich markup, which would eat a bare `[default: ...]`)."""
    text = field.description or ""
    if len(choices := _choices(field.annotation)) > 3:
        text += f" One of: {', '.join(choices)}."
    text += f" (env {env_name(name)}, yaml {name})"
    shown = default_text(field)
    return shown_default(text, shown) if shown is not None else text


def _flag_names(name: str, flag_type: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if flag_type is bool:
        return [f"{flag}/--no-{flag[2:]}"]
    return [flag]


def with_config_options(
    exclude: Set[str] = frozenset(),
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
                default=typer.Option(
                    None,
                    "--config",
                    help="YAML file of settings, keys named like the flags with _ (model: tiny-s). Env FTIS_CONFIG.",
                    show_default=False,
                    rich_help_panel="Settings file",
                ),
                annotation=Path | None,
            )
        )
        params.append(
            inspect.Parameter(
                "help_all",
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(
                    False,
                    "--help-all",
                    help=f"Show every setting ({len(fields)}), not only the common ones, and exit.",
                    callback=_help_all,
                    is_eager=True,
                    expose_value=False,
                    show_default=False,
                ),
                annotation=bool,
            )
        )
        panel = "Options"
        for name, field in NodeConfig.model_fields.items():
            panel = PANELS.get(name, panel)
            if name not in fields:
                continue
            flag_type = _flag_type(field.annotation)
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(
                        None,
                        *_flag_names(name, flag_type),
                        help=option_help(name, field),
                        show_default=False,
                        rich_help_panel=panel,
                        metavar=_metavar(field, flag_type),
                        hidden=name not in COMMON,
                    ),
                    annotation=flag_type | None,
                )
            )

        def wrapper(**kwargs: Any) -> Any:
            own_kwargs = {p.name: kwargs.pop(p.name) for p in own}
            config_file = kwargs.pop("config_file")
            kwargs.pop("help_all", None)  # handled by its callback
            # typer gives [] for a repeatable flag that was not passed: treat it as "not given".
            overrides = {k: (None if v == [] else v) for k, v in kwargs.items()}
            try:
                config = NodeConfig.load(config_file, **overrides)
            except SettingsError as err:
                raise CliError(err.lines[0] if len(err.lines) == 1 else "; ".join(err.lines)) from None
            return fn(config=config, **own_kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return decorate


def _metavar(field: FieldInfo, flag_type: Any) -> str | None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("metavar"):
        return str(extra["metavar"])
    if choices := _choices(field.annotation):
        return "[" + "|".join(choices) + "]" if len(choices) <= 3 else "NAME"
    return {int: "INT", float: "FLOAT", Path: "PATH", str: "TEXT"}.get(flag_type)
