"""Where ``inferd serve`` is hosted: a managed platform (Amazon SageMaker, Google Vertex AI) named by
``--platform`` or ``server.platform``, or detected from the variables the platform sets, and what it dictates of
the server: the address it listens on and, for Vertex AI, its predict and health routes (api/platforms.py serves
them). Read once when the settings are built (the CLI, and again on SIGHUP), never at import.

- **SageMaker** runs the image as ``docker run IMAGE serve`` and sends ``GET /ping`` and ``POST /invocations`` to
  port 8080; in an inference pipeline or a multi-container endpoint it names the port in ``SAGEMAKER_BIND_TO_PORT``
  (which also tells inferd it runs there).
- **Vertex AI** sets ``AIP_HTTP_PORT`` (8080 unless the model's containerSpec.ports says otherwise),
  ``AIP_PREDICT_ROUTE`` and ``AIP_HEALTH_ROUTE`` (any of them tells inferd it runs there).

Both need the server on every interface (0.0.0.0). A ``--port`` or ``--host`` flag is kept: an operator's explicit
choice, and each worker's own address under ``inferd fleet``, whose environment is the platform's too (on Vertex AI,
give the model the port of the image's command: ``--container-ports``, so that AIP_HTTP_PORT names it). Otherwise
the platform's port variable wins over ``INFERD__SERVER__PORT`` and the configuration (the platform sends its
requests there), and without one, an ``INFERD__SERVER__PORT`` or ``INFERD__SERVER__HOST`` is kept and the platform's
default port, 8080, taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd.config import ConfigError

DEFAULT_PORT = 8080
# The variable naming the platform's port, and the others that say the process runs there.
PORT_VARIABLES = {"sagemaker": "SAGEMAKER_BIND_TO_PORT", "vertex": "AIP_HTTP_PORT"}
SIGNS = {"sagemaker": ("SAGEMAKER_BIND_TO_PORT",), "vertex": ("AIP_HTTP_PORT", "AIP_PREDICT_ROUTE", "AIP_HEALTH_ROUTE")}


def detect(environ: Mapping[str, str]) -> str | None:
    """The platform whose variables are set (None: none of them)."""
    return next((name for name, signs in SIGNS.items() if any(environ.get(v) for v in signs)), None)


def hosted(flags: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The flags' settings keys with what the platform dictates added (the flags unchanged when none is named or
    detected). ``flags`` are config_flags.overrides' (None: a flag not given)."""
    platform = flags.get("server.platform") or environ.get("INFERD__SERVER__PLATFORM") or detect(environ)
    if not platform:
        return dict(flags)
    out = {**flags, "server.platform": platform}
    if flags.get("server.host") is None and not environ.get("INFERD__SERVER__HOST"):
        out["server.host"] = "0.0.0.0"  # noqa: S104 (the platforms reach the container from outside it)
    if flags.get("server.port") is None:
        variable = PORT_VARIABLES.get(platform)
        named = environ.get(variable) if variable else None
        if named:
            out["server.port"] = _port(named, variable or "")
        elif not environ.get("INFERD__SERVER__PORT"):
            out["server.port"] = DEFAULT_PORT
    if platform == "vertex":
        for key, variable in (("server.platform_predict_route", "AIP_PREDICT_ROUTE"),
                              ("server.platform_health_route", "AIP_HEALTH_ROUTE")):
            if environ.get(variable) and flags.get(key) is None:
                out[key] = environ[variable]
    return out


def _port(value: str, variable: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"{variable}={value!r}: the platform's port must be a number from 1 to 65535")
    return port
