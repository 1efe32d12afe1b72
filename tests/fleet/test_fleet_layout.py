"""The layout and the rendered files, without starting anything: GPUs are fake ids, CPUs a number.

The rendered supervisord.conf is read back with supervisord's own parser, and each worker's settings are
built from it exactly as the worker builds them (its command line through inferd's CLI parser, its
environment, the rendered configuration folder), so "worker 3 gets GPU 1 and 0.475 of its memory" is checked
where it takes effect. nginx checks the rendered nginx.conf itself (``nginx -t``) before anything is printed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from pathlib import Path
from typing import Any

import pytest
from settingskit import make_settings

from inferd import cli
from inferd.api.errors import _TYPES
from inferd.fleet import files, host, render, worker_config
from inferd.fleet.files import RenderError
from inferd.fleet.host import find_nginx
from inferd.fleet.layout import plan, visible_gpus
from inferd.fleet.runner import supervisor_env
from inferd.settings import Settings

from .fleetkit import requires_nginx

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI reads the real environment; start every test from the files alone.
    for name in list(os.environ):
        if name.startswith("INFERD") or name in ("MODEL_PATH", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("INFERD_CONFIG_DIR", str(CONFIGS))


def counter(start: int = 20000) -> Any:
    ports = iter(range(start, start + 1000))
    return lambda: next(ports)


# -- the layout --------------------------------------------------------------------------------------------------


def test_four_workers_on_two_gpus_share_each_gpu_in_blocks() -> None:
    s = make_settings(layered="dev", fleet={"gpus": ["0", "1"], "workers_per_gpu": 2})
    layout = plan(s, [], cores=8, port=counter())
    assert [w.gpu for w in layout.workers] == ["0", "0", "1", "1"]
    assert [w.memory_fraction for w in layout.workers] == [0.475] * 4  # (1 - 0.05 margin) / 2
    assert [w.torch_threads for w in layout.workers] == [2] * 4  # 8 cores / 4 workers
    ports = [p for w in layout.workers for p in (w.port, w.admin_port)]
    assert len(set(ports)) == 8
    assert "0.475" in layout.table() and layout.summary() == "4 workers on 2 GPUs (0, 1)"


def test_uneven_workers_and_a_gpu_of_its_own() -> None:
    layout = plan(make_settings(layered="dev", fleet={"gpus": ["0", "1"], "workers": 5}), [], cores=2, port=counter())
    assert [w.gpu for w in layout.workers] == ["0", "0", "0", "1", "1"]
    assert [w.memory_fraction for w in layout.workers] == [0.3166, 0.3166, 0.3166, 0.475, 0.475]
    uuids = make_settings(layered="dev", fleet={"gpus": ["GPU-uuid-a", "GPU-uuid-b"]})
    alone = plan(uuids, [], cores=4, port=counter())
    assert [(w.gpu, w.memory_fraction) for w in alone.workers] == [("GPU-uuid-a", None), ("GPU-uuid-b", None)]


def test_an_operators_smaller_memory_fraction_stands() -> None:
    s = make_settings(layered="dev", fleet={"gpus": ["0"], "workers_per_gpu": 2}, memory={"per_process_fraction": 0.3})
    assert [w.memory_fraction for w in plan(s, [], 4, counter()).workers] == [0.3, 0.3]


def test_default_gpus_are_the_visible_ones_and_none_means_cpu() -> None:
    assert [w.gpu for w in plan(make_settings(layered="dev"), ["3", "5"], 4, counter()).workers] == ["3", "5"]
    cpu = plan(make_settings(layered="dev"), [], 4, counter())
    assert [w.gpu for w in cpu.workers] == [None, None] and cpu.summary() == "2 workers on the CPU (4 cores)"
    cpu_only = make_settings(layered="dev", fleet={"gpus": []})
    assert [w.gpu for w in plan(cpu_only, ["0"], 4, counter()).workers] == [None, None]  # [] = CPU only


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, 2, 1), (8, 3, 2), (2, 4, 1), (16, 4, 4), (1, 1, 1)])
def test_cpu_threads_are_the_cores_split_at_least_one(cores: int, workers: int, threads: int) -> None:
    layout = plan(make_settings(layered="dev", fleet={"workers": workers}), [], cores, counter())
    assert [w.torch_threads for w in layout.workers] == [threads] * workers


def test_explicit_ports_and_threads() -> None:
    s = make_settings(layered="dev", fleet={"workers": 3, "worker_base_port": 9100}, runtime={"torch_threads": 3})
    layout = plan(s, [], 2, counter())
    assert [(w.port, w.admin_port, w.torch_threads) for w in layout.workers] == [(9100, 9101, 3), (9102, 9103, 3),
                                                                                 (9104, 9105, 3)]


@pytest.mark.parametrize(("value", "gpus"), [("0,1", ("0", "1")), ("", ()), ("2, 3", ("2", "3")), ("0,-1,2", ("0",)),
                                             ("-1", ())])
def test_visible_gpus_follow_cuda_visible_devices(value: str, gpus: tuple[str, ...]) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == gpus


def test_fleet_settings_from_the_environment() -> None:
    s = make_settings(layered="dev", environ={"INFERD__FLEET__GPUS": "0,1", "INFERD__FLEET__WORKERS_PER_GPU": "2"})
    assert s.fleet.gpus == ("0", "1") and s.fleet.workers_per_gpu == 2
    assert make_settings(layered="dev", environ={"INFERD__FLEET__GPUS": "3"}).fleet.gpus == ("3",)


# -- the templates ----------------------------------------------------------------------------------------------


def test_fill_repeats_blocks_and_refuses_unknown_placeholders() -> None:
    text = "a {{x}}\n#@each worker\nserver {{name}} {{x}};\n#@end\nz\n"
    assert files.fill(text, {"x": 1}, {"worker": [{"name": "w0"}, {"name": "w1"}]}) == \
        "a 1\nserver w0 1;\nserver w1 1;\nz\n"
    with pytest.raises(RenderError, match="y"):
        files.fill("{{y}}", {})
    with pytest.raises(RenderError, match="gpu"):
        files.fill("#@each gpu\n{{x}}\n#@end\n", {"x": 1})


def test_nginx_error_pages_speak_inferds_error_shape() -> None:
    """Every answer nginx makes itself is {"error": {message, type, code, param}} with inferd's type names."""
    text = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    pages = dict(re.findall(r"error_page (\d+) (?:=\d+ )?/_inferd/error/(\d+);", text))
    bodies = {int(code): (int(status), json.loads(body)) for code, status, body in
              re.findall(r"location = /_inferd/error/(\d+) \{[^}]*?return (\d+) '(.*?)';", text, re.S)}
    assert set(pages) >= {"400", "413", "414", "494", "502", "503", "504"}
    assert {int(v) for v in pages.values()} == set(bodies)
    for code, (status, body) in bodies.items():
        assert status == code and set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "code", "param"} and body["error"]["message"]
        if code in _TYPES:
            assert body["error"]["type"] == _TYPES[code], code
    assert pages["494"] == "431"  # "header too large" is 431, as inferd answers it
    assert "proxy_next_upstream error timeout http_503 http_429 non_idempotent;" in text and "least_conn;" in text


def test_nginx_never_marks_a_worker_failed_and_caps_no_connections(tmp_path: Path) -> None:
    settings = make_settings(layered="dev", environ={"INFERD__FLEET__WORKERS": "2", "INFERD__FLEET__GPUS": ""})
    layout = plan(settings, visible_gpus(), 2)
    fleet = render.Fleet(settings, layout, tmp_path, 18990, "/usr/sbin/nginx", "key")
    text = render.render_nginx(fleet)
    servers = re.findall(r"^\s*server 127\.0\.0\.1:(\d+) ([^;]*);", text, re.M)
    assert [(int(p), opts) for p, opts in servers] == [(w.port, "max_fails=0") for w in layout.workers]
    assert "zone inferd_workers" in text and "max_conns" not in text


def test_missing_nginx_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host.shutil, "which", lambda *a, **k: None)
    with pytest.raises(RenderError) as info:
        find_nginx(None)
    assert "apt-get install nginx" in str(info.value) and "\n" not in str(info.value)


def test_missing_nginx_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    monkeypatch.setattr(host.shutil, "which", lambda *a, **k: None)
    assert cli.main(["fleet", "--run-dir", str(tmp_path / "run"), "--port", "18999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install nginx" in err


# -- the rendered files, as supervisord and each worker read them ---------------------------------------------------


def print_config(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], run_dir: Path,
                 model: Path, env: dict[str, str], *args: str) -> str:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["fleet", "--print-config", "--run-dir", str(run_dir), "--model-path", str(model), *args]) == 0
    return capsys.readouterr().out


def programs(run_dir: Path) -> dict[str, Any]:
    from supervisor.options import ServerOptions

    options = ServerOptions()
    options.realize(args=["-c", str(run_dir / "supervisord.conf")])
    return {p.name: p for g in options.process_group_configs for p in g.process_configs}


def worker_settings(monkeypatch: pytest.MonkeyPatch, program: Any) -> Settings:
    """The Settings this worker builds: its flags through inferd's parser, its environment as supervisord sets it."""
    argv = shlex.split(program.command)
    assert argv[1:4] == ["-m", "inferd.cli", "serve"]
    environ = {**supervisor_env(), **program.environment}
    with monkeypatch.context() as m:
        for name in list(os.environ):
            m.delenv(name)
        for k, v in environ.items():
            m.setenv(k, v)
        return cli.settings_from_args(cli.build_parser().parse_args(argv[3:]))


@requires_nginx
def test_four_workers_on_two_fake_gpus_in_the_rendered_config(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = print_config(monkeypatch, capsys, run_dir, tiny_model,
                       {"INFERD__FLEET__GPUS": "0,1", "INFERD__FLEET__WORKERS_PER_GPU": "2",
                        "INFERD__MODEL__DEVICE": "cuda:1"}, "--port", "18998")
    assert "4 workers on 2 GPUs (0, 1)" in out
    progs = programs(run_dir)
    assert sorted(progs) == ["nginx", "worker-0", "worker-1", "worker-2", "worker-3"]
    key = (run_dir / "admin.key").read_text().strip()
    seen = []
    for name in ["worker-0", "worker-1", "worker-2", "worker-3"]:
        env = progs[name].environment
        s = worker_settings(monkeypatch, progs[name])
        seen.append((env["CUDA_VISIBLE_DEVICES"], s.memory.per_process_fraction))
        assert s.server.host == "127.0.0.1" and s.server.admin_key == key and s.server.admin_port
        assert s.model.path == str(tiny_model) and s.model.device == "cuda"  # its one GPU is cuda:0 to it
        assert progs[name].stopwaitsecs > s.server.drain_timeout_s + 5
        assert progs[name].stopsignal.name == "SIGTERM"
    assert seen == [("0", 0.475), ("0", 0.475), ("1", 0.475), ("1", 0.475)]
    assert progs["nginx"].stopsignal.name == "SIGQUIT"


@requires_nginx
def test_print_config_on_a_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    out = print_config(monkeypatch, capsys, run_dir, tiny_model,
                       {"INFERD__FLEET__GPUS": "", "INFERD__SERVER__ADMIN_KEY": "operator-secret",
                        "INFERD__LIMITS__MAX_BODY_BYTES": "5000", "INFERD__SERVER__MAX_HEADER_BYTES": "4096"},
                       "--workers", "3", "--port", "18997", "--torch-threads", "2")
    # The last column: the one model's instances x threads in the worker (configs' default, one of two threads).
    table = re.findall(r"^worker-(\d)\s+(\d+)\s+(\d+)\s+cpu\s+2\s+-\s+\S+ 1x2$", out, re.M)
    assert [t[0] for t in table] == ["0", "1", "2"]
    progs = programs(run_dir)
    for num, port, admin in table:
        s = worker_settings(monkeypatch, progs[f"worker-{num}"])
        assert (s.server.port, s.server.admin_port, s.runtime.torch_threads) == (int(port), int(admin), 2)
        assert progs[f"worker-{num}"].environment["CUDA_VISIBLE_DEVICES"] == ""  # a GPU host's workers stay on CPU
        assert s.memory.per_process_fraction is None
        assert s.server.tenant_limits_fraction == pytest.approx(1 / 3)  # each enforces its part of a tenant's limits
    nginx = (run_dir / "nginx.conf").read_text()
    assert out.count("server 127.0.0.1:") == 3 and nginx.count("server 127.0.0.1:") == 3
    assert "client_max_body_size 5000;" in nginx and "large_client_header_buffers 4 4096;" in nginx
    assert "listen 127.0.0.1:18997;" in nginx
    # The operator's key is used, never printed; files holding keys are the owner's alone.
    assert "operator-secret" not in out and (run_dir / "admin.key").read_text().strip() == "operator-secret"
    for secret in ("admin.key", "config/base.yaml", "supervisord.conf"):
        assert stat.S_IMODE((run_dir / secret).stat().st_mode) == 0o600, secret
    targets = json.loads((run_dir / "prometheus" / "targets.json").read_text())
    assert [(t["labels"]["worker"], t["targets"]) for t in targets] == \
        [(f"worker-{n}", [f"127.0.0.1:{p}"]) for n, p, _ in table]
    assert not (run_dir / "supervisor.sock").exists()  # printed, not started


@requires_nginx
def test_a_models_list_reaches_every_worker_with_absolute_paths_and_each_models_rules(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model: Path,
        tiny_model_v2: Path) -> None:
    config = tmp_path / "configs"
    config.mkdir()
    (config / "base.yaml").write_text((Path(__file__).resolve().parents[2] / "configs" / "base.yaml").read_text())
    monkeypatch.chdir(tiny_model.parent)
    (config / "dev.yaml").write_text(json.dumps({"models": [
        {"name": "embedder", "path": tiny_model.name, "device": "cuda:1"},
        {"name": "second", "path": str(tiny_model_v2), "batching": {"max_batch_size": 4}, "required": False,
         "canary": {"path": tiny_model.name, "version": "c", "weight": 0.25}}]}))
    run_dir = tmp_path / "run"
    print_config(monkeypatch, capsys, run_dir, tiny_model, {"INFERD_CONFIG_DIR": str(config),
                                                            "INFERD__FLEET__GPUS": ""}, "--workers", "2",
                 "--port", "18996")
    progs = programs(run_dir)
    for name in ("worker-0", "worker-1"):
        s = worker_settings(monkeypatch, progs[name])
        first, second = s.served()
        assert (first.name, first.model.path, first.model.device) == ("embedder", str(tiny_model), "cuda")
        assert first.model.root == (str(tiny_model.parent),)  # pinned: a restarted worker accepts the same paths
        assert (second.name, second.model.path, second.batching.max_batch_size, second.required) == (
            "second", str(tiny_model_v2), 4, False)
        assert (second.canary.path, second.canary.weight) == (str(tiny_model), 0.25)


def test_a_rollout_of_one_model_rewrites_that_models_entry_only(tmp_path: Path) -> None:
    from inferd.fleet.rollout import Change, Rollout

    entries = [{"name": "embedder", "path": "/m/a", "version": "1", "canary": {"path": None}},
               {"name": "reranker", "path": "/m/r", "version": "1", "canary": {"path": None}}]
    worker_config.write_worker_config(tmp_path, "dev", {"model": {"path": "/unused"}, "models": entries})

    class Run:
        path, meta, admin_key = tmp_path, {"env": "dev"}, "k"

    rollout = Rollout(Run(), client=None)  # type: ignore[arg-type]  # _persist talks to no worker
    rollout._persist(Change("reload", "/m/r2", "2", model="reranker"),
                     [{"active": {"model": "reranker", "path": "/m/r2", "version": "2"}}])
    rollout._persist(Change("canary", "/m/e2", "c", 0.1, model="embedder"),
                     [{"canary": {"model": "embedder", "path": "/m/e2", "version": "c"}, "weight": 0.1}])
    data = worker_config.read_worker_config(tmp_path)
    embedder, reranker = data["models"]
    assert (reranker["path"], reranker["version"]) == ("/m/r2", "2")
    assert (embedder["path"], embedder["version"], embedder["canary"]) == (
        "/m/a", "1", {"path": "/m/e2", "version": "c", "weight": 0.1})
    assert data["model"] == {"path": "/unused"}


@requires_nginx
def test_a_grpc_fleet_gives_each_worker_its_grpc_port_behind_nginxs_http2_listener(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model: Path) -> None:
    # The configuration's own gRPC port would be every worker's: each gets one of its own instead (issue 44).
    env = {"INFERD__FLEET__GPUS": "", "INFERD__FLEET__GRPC_PORT": "18443", "INFERD__SERVER__GRPC_PORT": "50051"}
    print_config(monkeypatch, capsys, tmp_path / "run", tiny_model, env, "--workers", "2", "--port", "18996")
    progs = programs(tmp_path / "run")
    ports = [worker_settings(monkeypatch, progs[f"worker-{i}"]).server.grpc_port for i in range(2)]
    assert None not in ports and len(set(ports)) == 2 and 50051 not in ports
    nginx = (tmp_path / "run" / "nginx.conf").read_text()  # nginx -t has passed on it
    assert "listen 127.0.0.1:18443 http2;" in nginx and "grpc_pass grpc://inferd_grpc_workers;" in nginx
    upstream = nginx[nginx.index("upstream inferd_grpc_workers"):nginx.index("grpc_pass")]
    assert [int(p) for p in re.findall(r"server 127\.0\.0\.1:(\d+) max_fails=0;", upstream)] == ports
    # Without fleet.grpc_port the fleet serves no gRPC: no listener, and no worker opens a port.
    monkeypatch.delenv("INFERD__FLEET__GRPC_PORT")
    print_config(monkeypatch, capsys, tmp_path / "plain", tiny_model, {}, "--workers", "2", "--port", "18995")
    plain = (tmp_path / "plain" / "nginx.conf").read_text()
    assert "inferd_grpc_workers" not in plain and "http2" not in plain
    assert worker_settings(monkeypatch, programs(tmp_path / "plain")["worker-0"]).server.grpc_port is None
