"""inferd/hosting.py: a managed platform named or detected from its variables, and the address and routes it
dictates: a port flag is kept; otherwise the platform's port variable wins over the environment's port."""

from __future__ import annotations

import pytest

from inferd.config import ConfigError
from inferd.hosting import detect, hosted

NO_FLAGS = {"server.host": None, "server.port": None, "server.platform": None}


def test_no_platform_leaves_the_flags_as_they_are() -> None:
    assert detect({"HOME": "/root"}) is None
    assert hosted(NO_FLAGS, {"INFERD__SERVER__PORT": "9000"}) == NO_FLAGS


@pytest.mark.parametrize(("environ", "platform"), [
    ({"SAGEMAKER_BIND_TO_PORT": "8081"}, "sagemaker"), ({"AIP_HTTP_PORT": "8080"}, "vertex"),
    ({"AIP_PREDICT_ROUTE": "/p"}, "vertex"), ({"AIP_HEALTH_ROUTE": "/h"}, "vertex")])
def test_each_platform_is_detected_from_its_variables(environ: dict[str, str], platform: str) -> None:
    assert detect(environ) == platform
    assert hosted(NO_FLAGS, environ)["server.platform"] == platform


def test_sagemaker_named_listens_on_every_interface_at_8080() -> None:
    out = hosted({**NO_FLAGS, "server.platform": "sagemaker"}, {})
    assert (out["server.host"], out["server.port"]) == ("0.0.0.0", 8080)
    assert hosted({**NO_FLAGS, "server.platform": "sagemaker"}, {"SAGEMAKER_BIND_TO_PORT": "9090"})["server.port"] \
        == 9090


def test_vertex_takes_its_port_and_routes_from_its_variables_over_the_environments_port() -> None:
    environ = {"AIP_HTTP_PORT": "7070", "AIP_PREDICT_ROUTE": "/v1/endpoints/1/deployedModels/2:predict",
               "AIP_HEALTH_ROUTE": "/v1/endpoints/1/deployedModels/2", "INFERD__SERVER__PORT": "9000"}
    out = hosted(NO_FLAGS, environ)
    assert out["server.port"] == 7070
    assert out["server.platform_predict_route"] == environ["AIP_PREDICT_ROUTE"]
    assert out["server.platform_health_route"] == environ["AIP_HEALTH_ROUTE"]


def test_a_port_flag_is_kept_over_the_platforms_variable_and_the_environments_port_is_not() -> None:
    flags = {**NO_FLAGS, "server.port": 8000, "server.host": "127.0.0.1"}  # as a fleet's worker is started
    out = hosted(flags, {"AIP_HTTP_PORT": "7070"})
    assert (out["server.host"], out["server.port"]) == ("127.0.0.1", 8000)
    assert hosted(NO_FLAGS, {"AIP_HTTP_PORT": "7070", "INFERD__SERVER__PORT": "8000"})["server.port"] == 7070
    # Without the platform's own port variable, the environment's port and host stand (not overridden).
    out = hosted({**NO_FLAGS, "server.platform": "sagemaker"},
                 {"INFERD__SERVER__PORT": "9000", "INFERD__SERVER__HOST": "127.0.0.1"})
    assert "server.port" not in out or out["server.port"] is None
    assert out["server.host"] is None


def test_a_bad_platform_port_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="AIP_HTTP_PORT='eighty'"):
        hosted(NO_FLAGS, {"AIP_HTTP_PORT": "eighty"})
