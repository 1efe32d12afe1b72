"""What matters in the built manifests, checked against inferd itself: a real `inferd serve` started with the
pod's own configuration (the ConfigMap's prod.yaml, the Deployment's environment) answers the probes and
exports the metrics the autoscalers use; `inferd check-config` accepts every variable the manifests set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from conftest import Server, free_port, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from inferd.config import load_settings
from inferd.settings import Settings

from .dockerfile import last, parse
from .k8s_objects import (
    ROOT,
    SHUTDOWN_MARGIN_S,
    Docs,
    config_map_data,
    container,
    objects,
    one,
    quantity,
    resolve_env,
)

SERVING = ("overlays/cpu", "overlays/gpu", "overlays/keda")
HPAS = ("overlays/cpu", "overlays/gpu")
# Variables the image's programs read that are not settings keys (inferd reads these two itself).
INFERD_PROCESS_VARS = {"INFERD_ENV", "INFERD_CONFIG_DIR"}


def pod_spec(docs: Docs) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def settings_of(docs: Docs, config_dir: Path) -> Settings:
    """The Settings a pod of this build would run with."""
    env = resolve_env(docs)
    return load_settings(env.get("INFERD_ENV"), environ=env, config_dir=config_dir)


@pytest.fixture(scope="module")
def pod_server(built: dict[str, Docs], tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
               module_serve: Callable[..., Server]) -> Server:
    """inferd as the cpu overlay's pod runs it, on loopback ports, with the tiny model in place of the volume."""
    tmp = tmp_path_factory.mktemp("pod")
    configs = tmp / "configs"
    configs.mkdir()
    (configs / "base.yaml").write_text((ROOT / "configs" / "base.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    docs = built["overlays/cpu"]
    (configs / "prod.yaml").write_text(config_map_data(docs, "inferd-config")["prod.yaml"], encoding="utf-8")
    env = resolve_env(docs)
    # module_serve picks the port and host; the model and the writable folders are this machine's.
    for key in ("INFERD__SERVER__PORT", "INFERD__SERVER__HOST"):
        env.pop(key, None)
    # The jobs' store is the cluster's PostgreSQL (from a Secret: a placeholder here), their files its volume's:
    # SQLite and the files in this machine's folder.
    env.pop("INFERD__JOBS__DATABASE_URL")
    env["INFERD__JOBS__DATA_DIR"] = str(tmp / "jobs")
    env.update({"INFERD_CONFIG_DIR": str(configs), "INFERD__SERVER__ADMIN_PORT": str(free_port()),
                "INFERD__SERVER__GRPC_PORT": str(free_port()),
                "INFERD__MODEL__PATH": str(tiny_model), "INFERD__MODEL__ROOT": str(tiny_model.parent),
                "INFERD__RUNTIME__TORCH_THREADS": "1", "HF_HOME": str(tmp / "hf"),
                # prod.yaml's backend auto would export and judge in the background here: torch, as every suite
                # server not about auto (tests/integration/test_auto_backend.py is), and a writable cache.
                "INFERD__MODEL__BACKEND": "torch", "INFERD__MODEL__CACHE_DIR": str(tmp / "cache")})
    server = module_serve(env, wait="/health/ready")
    # One inference, so the per-version histograms have a series (a labelled metric appears on first use).
    r = httpx.post(server.url + "/predict", json={"texts": ["hello world"]},
                   headers={"Authorization": f"Bearer {env['INFERD__SERVER__API_KEYS']}"}, timeout=30)
    assert r.status_code == 200, r.text
    return server


@pytest.fixture(scope="module")
def exported(pod_server: Server) -> set[str]:
    """Every sample name the running inferd exports."""
    text = httpx.get(pod_server.url + "/metrics", timeout=10).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def config_for(pod_config_dir: Callable[[Docs], Path]) -> Callable[[Docs], Settings]:
    return lambda docs: settings_of(docs, pod_config_dir(docs))


# -- probes and ports -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVING)
def test_probes_hit_inferds_health_routes_on_its_port(built: dict[str, Docs], name: str, pod_server: Server,
                                                      config_for: Callable[[Docs], Settings]) -> None:
    docs = built[name]
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    server = config_for(docs).server
    assert ports == {"http": server.port, "grpc": server.grpc_port}, \
        "the container ports must be the ports inferd listens on"
    key = resolve_env(docs)["INFERD__SERVER__API_KEYS"]  # the schema is behind the keys (server.docs)
    routes = set(httpx.get(pod_server.url + "/openapi.json", headers={"Authorization": f"Bearer {key}"},
                           timeout=10).json()["paths"])
    wanted = {"startupProbe": "/health/live", "livenessProbe": "/health/live"}
    for probe, path in wanted.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["path"] in routes, (probe, get)
        assert ports.get(get["port"], get["port"]) == ports["http"], (probe, get)
        assert httpx.get(pod_server.url + get["path"], timeout=5).status_code == 200, probe
    # Readiness over gRPC: the standard health service of the whole server ("" unless the probe names one).
    ready = c["readinessProbe"]["grpc"]
    assert ready["port"] == ports["grpc"] and ready.get("service", "") == ""
    # The health service follows readiness within grpc/server.py's HEALTH_EVERY_S (0.5 s): this server has just
    # turned ready over HTTP, so the probe's target is asked until it says SERVING (a kubelet probes every period).
    with grpc.insecure_channel(f"127.0.0.1:{pod_server.env['INFERD__SERVER__GRPC_PORT']}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
                 == health_pb2.HealthCheckResponse.SERVING, timeout=10, what="gRPC health SERVING", every=0.1)


def test_the_startup_budget_covers_a_model_load(built: dict[str, Docs]) -> None:
    for name in SERVING:
        c = container(built[name])
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
        # Liveness may restart a pod; it must not do so while a slow start is still within its budget.
        assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 20


def test_the_admin_port_is_neither_published_nor_on_the_main_port(built: dict[str, Docs], pod_server: Server,
                                                                  config_for: Callable[[Docs], Settings]) -> None:
    for name in SERVING:
        docs = built[name]
        admin = config_for(docs).server.admin_port
        assert admin is not None, "admin routes must move off the served port"
        assert admin not in {p["containerPort"] for p in container(docs)["ports"]}
        service = one(docs, "Service")
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http", "grpc"]
    key = {"Authorization": f"Bearer {pod_server.env['INFERD__SERVER__ADMIN_KEY']}"}
    assert httpx.get(pod_server.url + "/admin/models", headers=key, timeout=5).status_code == 404
    assert httpx.get(pod_server.admin_url + "/admin/models", headers=key, timeout=5).status_code == 200


def test_the_service_and_servicemonitor_select_the_pods(built: dict[str, Docs]) -> None:
    for name in SERVING:
        docs = built[name]
        labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        service = one(docs, "Service")
        assert service["spec"]["selector"].items() <= labels.items()
        monitor = one(docs, "ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
        assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


# -- rolling updates and shutdown ------------------------------------------------------------------------------


def prestop_seconds(c: dict[str, Any]) -> float:
    handler = c["lifecycle"]["preStop"]
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    command = handler["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop must be a plain sleep, not {command}"
    return float(command[1])


@pytest.mark.parametrize("name", SERVING)
def test_grace_period_outlasts_prestop_drain_and_shutdown(built: dict[str, Docs], name: str,
                                                          config_for: Callable[[Docs], Settings]) -> None:
    docs = built[name]
    drain = config_for(docs).server.drain_timeout_s  # configs/base.yaml, overlaid by the ConfigMap and env
    pre_stop = prestop_seconds(container(docs))
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    assert pre_stop >= 5, "the preStop delay is what lets endpoints drop the pod before SIGTERM"
    assert grace > pre_stop + drain + SHUTDOWN_MARGIN_S, (
        f"terminationGracePeriodSeconds {grace} must exceed preStop {pre_stop} + drain_timeout_s {drain} "
        f"+ shutdown margin {SHUTDOWN_MARGIN_S}: the kubelet SIGKILLs at the end of it")


@pytest.mark.parametrize("name", SERVING)
def test_rolling_update_never_goes_below_the_wanted_count(built: dict[str, Docs], name: str) -> None:
    deployment = one(built[name], "Deployment")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert (rolling["maxUnavailable"], rolling["maxSurge"]) == (0, 1)
    pdb = one(built[name], "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    minimum = min_replicas(built[name])
    assert pdb["spec"]["maxUnavailable"] < minimum, "a drain must leave one pod serving"
    spread = pod_spec(built[name])["topologySpreadConstraints"]
    assert {s["topologyKey"] for s in spread} == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}


# -- weights, user, resources ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVING)
def test_weights_come_from_a_read_only_volume_never_the_image(built: dict[str, Docs], name: str,
                                                              config_for: Callable[[Docs], Settings]) -> None:
    docs = built[name]
    model_path = config_for(docs).model.path
    assert model_path, "without model.path the image's packaged MiniLM would be served: weights in the image"
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    mounts = [m for m in container(docs)["volumeMounts"]
              if f"{model_path}/".startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{model_path} is under no volume mount: it would be read from the image"
    mount = mounts[0]
    assert mount.get("readOnly") is True
    assert "persistentVolumeClaim" in volumes[mount["name"]]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in {p["metadata"]["name"] for p in objects(docs, "PersistentVolumeClaim")}
    workdir = last(parse(ROOT / "Dockerfile"), "WORKDIR")
    assert workdir is not None and not model_path.startswith(workdir.args.rstrip("/") + "/")


@pytest.mark.parametrize("name", SERVING)
def test_the_pod_runs_as_the_images_non_root_user_locked_down(built: dict[str, Docs], name: str) -> None:
    spec = pod_spec(built[name])
    user = last(parse(ROOT / "Dockerfile"), "USER")
    assert user is not None
    uid = int(user.args.split(":")[0])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid != 0
    assert spec["automountServiceAccountToken"] is False
    c = container(built[name])
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
    # A read-only root needs somewhere to write: /tmp is an emptyDir, and HF_HOME lies under it.
    volumes = {v["name"]: v for v in spec["volumes"]}
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in volumes[tmp["name"]]
    assert resolve_env(built[name])["HF_HOME"].startswith("/tmp/")


@pytest.mark.parametrize("name", SERVING)
def test_every_container_has_requests_and_limits(built: dict[str, Docs], name: str) -> None:
    resources = container(built[name])["resources"]
    for kind in ("cpu", "memory"):
        request, limit = quantity(resources["requests"][kind]), quantity(resources["limits"][kind])
        assert 0 < request <= limit, (kind, request, limit)


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_gpu_settings(built: dict[str, Docs],
                                                              config_for: Callable[[Docs], Settings]) -> None:
    gpu, cpu = built["overlays/gpu"], built["overlays/cpu"]
    resources = container(gpu)["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert "nvidia.com/gpu" not in container(cpu)["resources"]["limits"]
    assert pod_spec(gpu)["nodeSelector"] and pod_spec(gpu)["tolerations"]
    on_gpu, on_cpu = config_for(gpu), config_for(cpu)
    assert (on_gpu.model.device, on_gpu.model.dtype) == ("cuda", "float16")
    assert on_cpu.model.dtype == "float32"
    assert on_gpu.batching.min_padding_efficiency <= 0.5 < on_cpu.batching.min_padding_efficiency
    assert on_gpu.batching.max_batch_size > on_cpu.batching.max_batch_size


# -- every variable is a setting -------------------------------------------------------------------------------


def check_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "inferd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "inferd.cli"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERD") and k != "MODEL_PATH"}
    return subprocess.run([*cmd, "check-config"], env={**clean, **env}, capture_output=True, text=True, timeout=60)


def setting_at(config: dict[str, Any], var: str) -> Any:
    node: Any = config
    for part in var[len("INFERD__"):].lower().split("__"):
        node = node[part]
    return node


def as_setting(raw: str, current: Any) -> Any:
    """The manifest's string as inferd reads it, to compare with what check-config printed."""
    if isinstance(current, list):
        return [p.strip() for p in raw.split(",") if p.strip()]
    if isinstance(current, str):
        return raw
    return yaml.safe_load(raw)


@pytest.mark.parametrize("name", SERVING)
def test_every_variable_the_manifests_set_is_an_inferd_setting(built: dict[str, Docs], name: str,
                                                               pod_config_dir: Callable[[Docs], Path]) -> None:
    docs = built[name]
    env = resolve_env(docs)
    inferd_vars = {k for k in env if k.startswith("INFERD")}
    odd = {k for k in inferd_vars if not k.startswith("INFERD__")} - INFERD_PROCESS_VARS
    assert not odd, f"{odd}: inferd reads INFERD__SECTION__KEY (two underscores), INFERD_ENV, INFERD_CONFIG_DIR"
    # prod.yaml is mounted where INFERD_CONFIG_DIR says, under the name INFERD_ENV picks.
    mount = next(m for m in container(docs)["volumeMounts"] if m.get("subPath") == "prod.yaml")
    assert mount["mountPath"] == f"{env['INFERD_CONFIG_DIR']}/{env['INFERD_ENV']}.yaml"
    env["INFERD_CONFIG_DIR"] = str(pod_config_dir(docs))
    result = check_config(env)
    assert result.returncode == 0, f"inferd check-config refused the {name} pod's environment:\n{result.stderr}"
    config = yaml.safe_load(result.stdout)
    secrets = {v["name"] for v in container(docs)["env"] if "secretKeyRef" in v.get("valueFrom", {})}
    for var in sorted(inferd_vars - INFERD_PROCESS_VARS):
        shown = setting_at(config, var)
        if var in secrets:
            assert shown == "***", f"{var} is not masked by check-config"
        else:
            assert shown == as_setting(env[var], shown), f"{var}={env[var]!r} but inferd runs with {shown!r}"


def test_check_config_refuses_a_misspelt_variable(built: dict[str, Docs],
                                                  pod_config_dir: Callable[[Docs], Path]) -> None:
    # What the test above relies on: an unknown key is an error, not silently ignored.
    docs = built["overlays/cpu"]
    env = {**resolve_env(docs), "INFERD_CONFIG_DIR": str(pod_config_dir(docs)), "INFERD__SERVER__DRAIN_TIMEOUT": "5"}
    result = check_config(env)
    assert result.returncode != 0 and "drain_timeout" in result.stderr


# -- autoscaling -----------------------------------------------------------------------------------------------


def min_replicas(docs: Docs) -> int:
    hpas = objects(docs, "HorizontalPodAutoscaler")
    return hpas[0]["spec"]["minReplicas"] if hpas else one(docs, "ScaledObject")["spec"]["minReplicaCount"]


def adapter_rules(built: dict[str, Docs]) -> list[dict[str, Any]]:
    return yaml.safe_load(one(built["prometheus-adapter"], "ConfigMap")["data"]["config.yaml"])["rules"]


def series_of(query: str) -> str:
    match = re.match(r"\s*([A-Za-z_:][\w:]*)", query)
    assert match, query
    return match.group(1)


@pytest.mark.parametrize("name", HPAS)
def test_hpa_metrics_are_served_by_the_adapter_from_series_inferd_exports(built: dict[str, Docs], name: str,
                                                                          exported: set[str]) -> None:
    hpa = one(built[name], "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inferd"}
    metrics = hpa["spec"]["metrics"]
    assert {m["type"] for m in metrics} == {"Pods"}, "never scale an inference service on CPU"
    names = [m["pods"]["metric"]["name"] for m in metrics]
    # The issue's metric, by its own name: texts waiting in the pod's queue.
    assert names[0] == "inferd_queue_depth" and names[0] in exported
    rules = {r["name"].get("as", series_of(r["seriesQuery"])): r for r in adapter_rules(built)}
    for metric in metrics:
        name_ = metric["pods"]["metric"]["name"]
        assert name_ in rules, f"no prometheus-adapter rule serves {name_}"
        series = series_of(rules[name_]["seriesQuery"])
        assert re.fullmatch(rules[name_]["name"]["matches"], series), (name_, series)
        if series.startswith("inferd_"):
            assert series in exported, f"{series} (behind {name_}) is not in inferd's /metrics"
        target = metric["pods"]["target"]
        assert target["type"] == "AverageValue" and quantity(target["averageValue"]) > 0


def test_keda_scales_like_the_cpu_hpa_on_series_inferd_exports(built: dict[str, Docs], exported: set[str]) -> None:
    keda, cpu = built["overlays/keda"], built["overlays/cpu"]
    assert not objects(keda, "HorizontalPodAutoscaler"), "KEDA owns the HPA; a second one would fight it"
    scaled = one(keda, "ScaledObject")["spec"]
    hpa = one(cpu, "HorizontalPodAutoscaler")["spec"]
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    targets = [quantity(m["pods"]["target"]["averageValue"]) for m in hpa["metrics"]]
    assert [float(t["metadata"]["threshold"]) for t in scaled["triggers"]] == targets
    for trigger in scaled["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        selected = set(re.findall(r"(inferd_\w+)\{", trigger["metadata"]["query"]))
        assert selected and selected <= exported, selected - exported
        assert 'namespace="inferd"' in trigger["metadata"]["query"]


@pytest.mark.parametrize("name", HPAS)
def test_hpa_scales_up_at_once_and_down_slower_than_a_model_load(built: dict[str, Docs], name: str) -> None:
    spec = one(built[name], "HorizontalPodAutoscaler")["spec"]
    up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    startup = container(built[name])["startupProbe"]
    load_budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert down["stabilizationWindowSeconds"] >= load_budget, "a scale-down must not undo a scale-up still loading"
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    # Scale-down goes one pod at a time, more slowly than scale-up adds them.
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
    assert min(p["periodSeconds"] for p in down["policies"]) > max(p["periodSeconds"] for p in up["policies"])
