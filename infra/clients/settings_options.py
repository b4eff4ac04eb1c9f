"""Command options written once: each under the settings field it sets, given to the commands that name it.

A service's settings (`capture.settings.CaptureSettings`, `replayer.settings.ReplayerSettings`) come from the
environment, overridden by the options given on the command line. The service writes each option once, in a dict
from settings field to its typer annotation, and a function that makes the settings from the options given (None:
not given); `settings_options` gives a command the options it names and calls it with the settings they make::

    @settings_options(OPTIONS, build_settings, "lane", "s3_bucket")
    def replay(request_id: Annotated[str, typer.Argument()], settings: ReplayerSettings) -> None: ...

The command's ``settings`` parameter is replaced, in its signature (the one typer reads), by those options, in
that place; the command itself sees only the settings.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

Command = Callable[..., None]

#: The connection options every service shares (the fields of `infra.clients.connection`'s settings mixins).
CONNECTION_OPTIONS: dict[str, Any] = {
    "kafka_bootstrap": Annotated[str | None, typer.Option("--kafka-bootstrap", help="Kafka bootstrap servers")],
    "s3_endpoint": Annotated[str | None, typer.Option("--s3-endpoint", help="S3 endpoint URL")],
    "s3_bucket": Annotated[str | None, typer.Option("--s3-bucket", help="audit bucket (Object Lock)")],
    "s3_access_key": Annotated[str | None, typer.Option("--s3-access-key", help="S3 access key id")],
    "s3_secret_key": Annotated[
        str | None, typer.Option("--s3-secret-key", help="S3 secret key (prefer the environment)")
    ],
}


def settings_options(
    options: Mapping[str, Any], build: Callable[..., Any], *fields: str
) -> Callable[[Command], Command]:
    """Give a command the options of `fields` (keys of `options`) in place of its ``settings`` parameter, and call
    it with ``build(**given)``, every option named, None when not given."""
    unknown = sorted(set(fields) - options.keys())
    if unknown:
        raise KeyError(f"no settings option for {', '.join(unknown)}")

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        if "settings" not in signature.parameters:
            raise TypeError(f"{command.__name__} has no `settings` parameter to replace")
        params: list[inspect.Parameter] = []
        for param in signature.parameters.values():
            if param.name == "settings":
                params += [inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=options[f])
                           for f in fields]  # fmt: skip
            else:  # keyword-only, so the options may stand between parameters with and without defaults
                params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(command)
        def with_settings(**given: Any) -> None:
            chosen = {f: given.pop(f) for f in fields}
            command(settings=build(**chosen), **given)

        with_settings.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return with_settings

    return decorate
