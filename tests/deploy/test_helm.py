"""The Helm chart: `helm lint --strict` and `helm template` over the values files in
deploy/helm/baton/ci/, and checks on the rendered manifests. No Kubernetes API server runs here,
so this is what can be tested: the manifests themselves, not a cluster running them.

helm comes from $BATON_HELM, PATH, or deploy/helm/get-helm.sh's cache (.ci/run fetches it). When
none is found the tests are skipped, except when BATON_HELM is set (CI), where that fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "baton"
VALUES = {"defaults": None, **{p.stem.removesuffix("-values"): p
                               for p in sorted((CHART / "ci").glob("*-values.yaml"))}}


# no image is published: the chart requires one named (the ci/ values files name theirs)
IMAGE = ["--set", "image.repository=registry.example.com/baton", "--set", "image.tag=0.1.0-cpu"]


def helm_binary() -> str:
    env = os.environ.get("BATON_HELM")
    if env:
        assert Path(env).exists(), f"BATON_HELM={env} does not exist"
        return env
    cached = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    for cand in (shutil.which("helm"), cached / "helm" / "helm"):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.skip("no helm binary (run deploy/helm/get-helm.sh, or set BATON_HELM)")


@pytest.fixture(scope="module")
def helm():
    return helm_binary()


def render(helm, values: Path | None, *sets: str) -> list[dict]:
    cmd = [helm, "template", "rel", str(CHART), "--namespace", "serving"]
    cmd += ["-f", str(values)] if values is not None else IMAGE
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("name", VALUES)
def test_lint_strict(helm, name):
    cmd = [helm, "lint", "--strict", str(CHART)]
    cmd += ["-f", str(VALUES[name])] if VALUES[name] is not None else IMAGE
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", VALUES)
def test_rendered_manifests_hang_together(helm, name):
    docs = render(helm, VALUES[name])
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    assert {"rel-baton-router", "rel-baton-prefill", "rel-baton-decode"} <= set(deployments)
    for dname, d in deployments.items():
        spec = d["spec"]
        pod_labels = spec["template"]["metadata"]["labels"]
        sel = spec["selector"]["matchLabels"]
        assert sel.items() <= pod_labels.items(), f"{dname}: selector does not match its pods"
        for c in spec["template"]["spec"]["containers"]:
            assert c["resources"].get("requests"), f"{dname}/{c['name']}: no resource requests"
            assert "memory" in c["resources"].get("limits", {}), f"{dname}: no memory limit"
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{dname}: probes"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                pr = c.get(probe)
                if pr and "grpc" in pr:  # native gRPC probes: no tool needed in the image
                    assert pr["grpc"]["port"] in ports.values(), (dname, probe)
    # every Service selects pods of exactly one Deployment, on ports those pods expose
    for sname, s in services.items():
        targets = [d for d in deployments.values() if s["spec"]["selector"].items()
                   <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"service {sname} selects {len(targets)} deployments"
        c = targets[0]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"] for p in c["ports"]}
        for p in s["spec"]["ports"]:
            assert p["targetPort"] in named, (sname, p)
    # PDBs and HPAs point at real things
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in deployments.values()), pdb["metadata"]["name"]
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        target = hpa["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        assert "replicas" not in deployments[target]["spec"], "HPA and fixed replicas fight"


def worker_env(dep) -> dict:
    c = dep["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in c.get("env", [])}


def test_defaults_wire_workers_to_the_in_chart_redis(helm):
    docs = render(helm, None)
    deps = by_kind(docs, "Deployment")
    assert "rel-baton-redis" in deps and "rel-baton-redis" in by_kind(docs, "Service")
    for role in ("prefill", "decode"):
        dep = deps[f"rel-baton-{role}"]
        c = dep["spec"]["template"]["spec"]["containers"][0]
        args = c["args"]
        assert args[:3] == ["worker", "--role", role]
        assert "--redis-url" not in args  # the URL carries a password: env only, never argv
        env = worker_env(dep)
        assert env["BATON_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@rel-baton-redis:6379/0"
        # $(VAR) expands only from variables defined before it
        names = list(env)
        assert names.index("REDIS_PASSWORD") < names.index("BATON_REDIS_URL")
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "rel-baton-redis-auth", "key": "password"}
        assert env["BATON_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": "rel-baton-cluster-secret", "key": "secret"}
        # workers register their pod IP, bind every interface
        assert env["BATON_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert args[args.index("--host") + 1] == "0.0.0.0"
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > int(args[args.index("--drain-timeout") + 1])  # drain before SIGKILL
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert args[args.index("--device") + 1] == "cpu"  # never a GPU it was not given
    router = deps["rel-baton-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][0] == "router"
    assert router["args"][router["args"].index("--routing") + 1] == "cache-aware"
    svc = by_kind(docs, "Service")["rel-baton-router"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000}


def test_gpu_pools(helm):
    docs = render(helm, VALUES["gpu-pools"])
    deps = by_kind(docs, "Deployment")
    for role, replicas in (("prefill", 2), ("decode", 4)):
        spec = deps[f"rel-baton-{role}"]["spec"]
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        assert spec["replicas"] == replicas
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        args = c["args"]
        assert args[args.index("--device") + 1] == "cuda"
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert worker_env(deps[f"rel-baton-{role}"])["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc"
        assert c["args"][c["args"].index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"] == {
            "claimName": "models"}
    # helm --set hands 0.45 over as a string; the schema takes it
    shared = by_kind(render(helm, VALUES["gpu-pools"], "decode.gpuMemoryUtilization=0.45"),
                     "Deployment")["rel-baton-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert shared["args"][shared["args"].index("--gpu-memory-utilization") + 1] == "0.45"
    assert "UCX_NET_DEVICES" in worker_env(deps["rel-baton-prefill"])
    assert "UCX_NET_DEVICES" not in worker_env(deps["rel-baton-decode"])  # per pool


def test_kv_tiers_pass_their_flags_and_mount_the_disk_tier(helm):
    deps = by_kind(render(helm, VALUES["gpu-pools"], "prefill.kvTiers.diskGb=8",
                          "prefill.kvTiers.hostGb=16"), "Deployment")
    pod = deps["rel-baton-prefill"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--kv-host-tier-gb") + 1] == "16"
    assert args[args.index("--kv-disk-tier-gb") + 1] == "8"
    assert args[args.index("--kv-disk-tier-dir") + 1] == "/var/lib/baton/kv-tier"
    assert {"name": "kv-tier", "mountPath": "/var/lib/baton/kv-tier"} in pod["containers"][0][
        "volumeMounts"]
    assert {"name": "kv-tier", "emptyDir": {}} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in pod["containers"][0][
        "volumeMounts"]
    # the decode pool has neither: its worker's own defaults (4 GiB host tier on a GPU)
    dec = deps["rel-baton-decode"]["spec"]["template"]["spec"]
    assert not any(a.startswith("--kv-") for a in dec["containers"][0]["args"])
    assert "kv-tier" not in [v["name"] for v in dec["volumes"]]
    # without a model volume the tier's mount stands beside the writable dirs and /dev/shm
    pod = by_kind(render(helm, None, "prefill.kvTiers.diskGb=1"), "Deployment")[
        "rel-baton-prefill"]["spec"]["template"]["spec"]
    assert [m["name"] for m in pod["containers"][0]["volumeMounts"]] == [
        "tmp", "cache", "kv-tier", "dshm"]


def test_tensor_parallel_pools_run_their_ranks_in_one_pod_on_a_memory_backed_shm(helm):
    deps = by_kind(render(helm, None, "decode.tensorParallelSize=2"), "Deployment")
    pod = deps["rel-baton-decode"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--device") + 1] == "cpu"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    # the group's KV pool (kvCacheGb, 1) lives there: it gets room for it and half a GiB
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1536Mi"}} in pod[
        "volumes"]
    pre = deps["rel-baton-prefill"]["spec"]["template"]["spec"]
    assert "--tensor-parallel-size" not in pre["containers"][0]["args"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pre[
        "volumes"]
    # on a GPU every rank of the group runs on the pod's one GPU, named
    gpu = by_kind(render(helm, VALUES["gpu-pools"], "prefill.tensorParallelSize=2"),
                  "Deployment")["rel-baton-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["args"][gpu["args"].index("--device") + 1] == "cuda:0"
    out = subprocess.run([helm, "template", "rel", str(CHART), *IMAGE, "--set", "decode.gpus=2"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "decode.gpus=2" in out.stderr and "not built" in out.stderr


def test_external_redis_from_a_secret_with_tracing_and_monitoring(helm):
    docs = render(helm, VALUES["external-redis"])
    assert "rel-baton-redis" not in by_kind(docs, "Deployment")
    for name, dep in by_kind(docs, "Deployment").items():
        env = worker_env(dep)
        assert env["BATON_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "baton-redis",
                                                                       "key": "url"}, name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http://otel-collector")
        assert env["OTEL_SERVICE_NAME"]["value"].startswith("baton-")
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    (pm,) = by_kind(docs, "PodMonitor").values()  # the workers' own /metrics
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for role in ("prefill", "decode"):
        c = by_kind(docs, "Deployment")[f"rel-baton-{role}"]["spec"]["template"]["spec"][
            "containers"][0]
        port = int(c["args"][c["args"].index("--metrics-port") + 1])
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]


def test_pools_autoscale_on_batons_own_metrics_not_cpu(helm):
    """The router on CPU (an HPA); each pool a KEDA ScaledObject whose triggers are the SLO
    autoscaler's signals, read from Prometheus: nothing scales a pool on CPU."""
    docs = render(helm, VALUES["autoscaling"])
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"rel-baton-router"}
    assert hpas["rel-baton-router"]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    scaled = by_kind(docs, "ScaledObject")
    assert set(scaled) == {"rel-baton-prefill", "rel-baton-decode"}
    d = scaled["rel-baton-decode"]["spec"]
    assert d["scaleTargetRef"] == {"name": "rel-baton-decode"}
    assert (d["minReplicaCount"], d["maxReplicaCount"]) == (2, 16)
    behavior = d["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60  # no flapping
    queries = {t["metadata"]["query"]: (t["metricType"], t["metadata"]["threshold"])
               for t in d["triggers"]}
    assert all(t["type"] == "prometheus" and t["metadata"]["serverAddress"]
               == "http://prometheus.monitoring:9090" for t in d["triggers"])
    by_metric = {m: v for q, v in queries.items() for m in (
        "vllm:num_requests_waiting", "baton_router_decode_queued", "vllm:kv_cache_usage_perc",
        'phase="decode_wait"', "baton_time_per_output_token_seconds") if m in q}
    assert by_metric['phase="decode_wait"'] == ("Value", "2")
    assert by_metric["vllm:kv_cache_usage_perc"] == ("Value", "0.7")
    assert by_metric["vllm:num_requests_waiting"] == ("AverageValue", "4")
    assert by_metric["baton_router_decode_queued"] == ("AverageValue", "4")  # one trigger
    assert not any("cpu" in q for q in queries)
    p = {t["metadata"]["query"]: t for t in scaled["rel-baton-prefill"]["spec"]["triggers"]}
    assert any("baton_ttft_prefill_side_seconds" in q for q in p)  # not the whole TTFT
    assert any("baton_worker_queue_depth" in q and 'pod=~"rel-baton-prefill-.*"' in q for q in p)
    # no RBAC: KEDA and HPAs are the cluster's own controllers; the chart grants nothing
    assert not [x for x in docs if x["kind"] in ("Role", "ClusterRole", "RoleBinding")]
    out = subprocess.run([helm, "template", "rel", str(CHART), *IMAGE, "--set",
                          "decode.autoscaling.enabled=true"], capture_output=True, text=True)
    assert out.returncode != 0 and "decode.autoscaling.prometheus" in out.stderr


@pytest.mark.parametrize("setting,message", [
    ("prefill.replicaz=2", "additional properties 'replicaz' not allowed"),
    ("router.routing=fastest", "value must be one of 'cache-aware'"),
    ("decode.replicas=-1", "minimum"),
    ("model.dtype=int3", "value must be one of"),
    ("router.scorers=speed=1", "does not match pattern"),
    ("redis.external.url=http://x", "does not match pattern"),
    ("decode.gpuMemoryUtilization=2", "gpuMemoryUtilization"),
    ("decode.gpuMemoryUtilization=1.5", "gpuMemoryUtilization"),
    ("prefill.kvTiers.diskGb=-1", "diskGb"),
    ("prefill.kvTiers.ssdGb=1", "additional properties 'ssdGb' not allowed"),
])
def test_invalid_values_fail_with_a_clear_message(helm, setting, message):
    out = subprocess.run([helm, "template", "rel", str(CHART), *IMAGE, "--set", setting],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert setting.split("=")[0].split(".")[0] in out.stderr  # names where


def test_external_redis_needs_a_url(helm):
    out = subprocess.run([helm, "template", "rel", str(CHART), *IMAGE, "--set",
                          "redis.enabled=false"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "set redis.external.url or redis.external.urlSecret.name" in out.stderr


def test_slo_autoscaler_scales_the_pools_with_least_privilege(helm):
    docs = render(helm, VALUES["slo-autoscaler"])
    deps = by_kind(docs, "Deployment")
    for pool in ("prefill", "decode"):  # the autoscaler owns their replicas
        assert "replicas" not in deps[f"rel-baton-{pool}"]["spec"]
    c = deps["rel-baton-autoscaler"]["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[:2] == ["autoscale", "--kubernetes"]

    def arg(flag):
        return args[args.index(flag) + 1]

    assert (arg("--prefill-deployment"), arg("--decode-deployment")) == (
        "rel-baton-prefill", "rel-baton-decode")
    assert (arg("--min-decode"), arg("--max-decode"), arg("--tpot-slo")) == ("2", "8", "0.05")
    env = {e["name"]: e for e in c["env"]}
    assert env["BATON_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@rel-baton-redis:")
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC, in the release's namespace: get/patch/update the two Deployments' scale, get the
    # two Deployments (their selectors), list and annotate pods (the pod-deletion cost that
    # makes a scale-down remove the pod the autoscaler chose); nothing else
    (role,) = by_kind(docs, "Role").values()
    scale, deployments, pods = role["rules"]
    assert scale["resources"] == ["deployments/scale"]
    assert set(scale["resourceNames"]) == {"rel-baton-prefill", "rel-baton-decode"}
    assert set(scale["verbs"]) <= {"get", "patch", "update"}
    assert deployments["resources"] == ["deployments"] and deployments["verbs"] == ["get"]
    assert set(deployments["resourceNames"]) == {"rel-baton-prefill", "rel-baton-decode"}
    assert pods == {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}
    (binding,) = by_kind(docs, "RoleBinding").values()
    sa = deps["rel-baton-autoscaler"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa,
                                    "namespace": "serving"}]
    assert not by_kind(docs, "HorizontalPodAutoscaler")


def test_slo_autoscaler_refuses_the_cpu_hpas_and_bad_bounds(helm):
    base = [helm, "template", "rel", str(CHART), *IMAGE, "--set", "sloAutoscaler.enabled=true"]
    out = subprocess.run([*base, "--set", "decode.autoscaling.enabled=true", "--set",
                          "decode.autoscaling.prometheus=http://p:9090"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "turn prefill.autoscaling and decode.autoscaling" in out.stderr
    out = subprocess.run([*base, "--set", "sloAutoscaler.decode.minReplicas=5"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "sloAutoscaler.decode: minReplicas (5) > maxReplicas (4)" in out.stderr


def test_workers_take_connections_from_the_release_only_and_router_limits(helm):
    docs = render(helm, None, "router.apiKeysSecret.name=baton-keys",
                  "router.maxConcurrentPerKey=8",
                  "networkPolicy.extraFrom[0].namespaceSelector.matchLabels.team=monitoring")
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {"rel-baton-prefill", "rel-baton-decode", "rel-baton-redis"}
    deps = by_kind(docs, "Deployment")
    for role in ("prefill", "decode"):
        spec = pols[f"rel-baton-{role}"]["spec"]
        pod_labels = deps[f"rel-baton-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
        peers = spec["ingress"][0]["from"]
        release = peers[0]["podSelector"]["matchLabels"]
        for other in ("router", "prefill", "decode"):  # every pod of the release may connect
            labels = deps[f"rel-baton-{other}"]["spec"]["template"]["metadata"]["labels"]
            assert release.items() <= labels.items(), other
        assert peers[1] == {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
        # only the metrics port is open to anyone (scrapers)
        c = deps[f"rel-baton-{role}"]["spec"]["template"]["spec"]["containers"][0]
        metrics = int(c["args"][c["args"].index("--metrics-port") + 1])
        assert spec["ingress"][1] == {"ports": [{"port": metrics, "protocol": "TCP"}]}
        assert len(spec["ingress"]) == 2
    # the router is not selected: clients reach it
    assert not any(p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                   == "router" for p in pols.values())
    router = deps["rel-baton-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[args.index("--max-concurrent-per-key") + 1] == "8"
    assert args[args.index("--max-concurrent") + 1] == "256"
    keyfile = args[args.index("--api-keys-file") + 1]
    mount = {m["name"]: m for m in router["containers"][0]["volumeMounts"]}["api-keys"]
    assert keyfile == f"{mount['mountPath']}/keys" and mount["readOnly"]
    vol = {v["name"]: v for v in router["volumes"]}[mount["name"]]
    assert vol["secret"]["secretName"] == "baton-keys"
    off = render(helm, None, "networkPolicy.enabled=false")
    assert not by_kind(off, "NetworkPolicy")
    plain = by_kind(off, "Deployment")["rel-baton-router"]["spec"]["template"]["spec"]
    assert "--api-keys-file" not in plain["containers"][0]["args"]
    assert "api-keys" not in [v["name"] for v in plain["volumes"]]


def test_secrets_reach_every_pod_in_its_environment_and_never_in_argv(helm):
    """The in-chart Redis needs a password and the workers the cluster secret, both generated
    into Secrets; every pod gets them from there as env vars; no container's command or args
    carry one; the router sends the cluster secret (it calls the workers); the autoscaler does
    not (it reads /metrics)."""
    import base64

    docs = render(helm, None)
    secrets = by_kind(docs, "Secret")
    password = base64.b64decode(secrets["rel-baton-redis-auth"]["data"]["password"]).decode()
    cluster = base64.b64decode(secrets["rel-baton-cluster-secret"]["data"]["secret"]).decode()
    assert len(password) >= 32 and password.isalnum() and len(cluster) >= 48
    again = by_kind(render(helm, None), "Secret")  # no live Secret to keep: a fresh value
    assert again["rel-baton-cluster-secret"]["data"] != secrets["rel-baton-cluster-secret"]["data"]
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            line = " ".join(c.get("command", []) + c.get("args", []))
            assert password not in line and cluster not in line and "redis://" not in line, name
    deps = by_kind(docs, "Deployment")
    for role in ("router", "prefill", "decode"):
        assert "BATON_CLUSTER_SECRET" in worker_env(deps[f"rel-baton-{role}"]), role
    redis = deps["rel-baton-redis"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["name"] == "rel-baton-redis-auth"
    # the in-chart Redis takes connections from the release's pods only, on its port
    (ingress,) = by_kind(docs, "NetworkPolicy")["rel-baton-redis"]["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 6379, "protocol": "TCP"}]
    assert ingress["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "rel"
    # your own Secrets instead: the chart makes none
    own = render(helm, None, "redis.auth.existingSecret=my-redis",
                 "clusterSecret.existingSecret=my-cluster")
    assert not by_kind(own, "Secret")
    env = worker_env(by_kind(own, "Deployment")["rel-baton-decode"])
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "my-redis"
    assert env["BATON_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "my-cluster"


def run_redis_container(c: dict, tmp_path: Path, password: str, data: Path | None = None):
    """The Redis container's shell command ``c``, run here with the local redis-server on a
    free loopback port (``/data`` -> ``data``); (process, client) once it answers."""
    import socket
    import time

    import redis
    from baton.control.redis_server import redis_server_binary

    assert c["command"] == ["sh", "-c"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = tmp_path / f"conf-{port}"
    conf.mkdir()
    script = (c["args"][0].replace("/run/redis", str(conf)).replace("--port 6379",
              f"--port {port} --bind 127.0.0.1"))
    if data is not None:
        script = script.replace("--dir /data", f"--dir {data}")
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        (bindir / "redis-server").symlink_to(redis_server_binary())
    # in its own directory: a redis-server with no --dir saves dump.rdb where it runs
    proc = subprocess.Popen(["sh", "-c", script], cwd=conf, env={
        "PATH": f"{bindir}:{os.environ['PATH']}", "REDIS_PASSWORD": password})
    client = redis.Redis(port=port, password=password)
    for _ in range(600):  # up to a minute for a slow machine; fails only on a hang
        try:
            client.ping()
            return proc, client
        except redis.ConnectionError:
            assert proc.poll() is None, "redis-server exited"
            time.sleep(0.1)
    raise AssertionError("the container's redis-server never answered")


def test_the_redis_containers_command_requires_the_password_and_hides_it(helm, tmp_path):
    """The Redis container's shell command, run here with the local redis-server: clients
    without the password are refused, with it they are served, and `ps` never shows it."""
    import redis

    docs = render(helm, None)
    c = by_kind(docs, "Deployment")["rel-baton-redis"]["spec"]["template"]["spec"][
        "containers"][0]
    password = "Pw" + os.urandom(12).hex()
    proc, client = run_redis_container(c, tmp_path, password)
    try:
        assert client.set("k", "v")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=client.connection_pool.connection_kwargs["port"]).get("k")
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert password not in ps
    finally:
        proc.terminate()
        proc.wait(30)


def test_redis_persistence_keeps_its_append_only_file_on_a_claim(helm, tmp_path):
    """With persistence the in-chart Redis writes an AOF to a PersistentVolumeClaim: its
    command, run here on a local directory, comes back from a SIGKILL with what it held."""
    import time

    docs = render(helm, None, "redis.persistence.enabled=true", "redis.persistence.size=5Gi",
                  "redis.persistence.storageClass=fast")
    pvc = by_kind(docs, "PersistentVolumeClaim")["rel-baton-redis-data"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["spec"]["storageClassName"] == "fast"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    spec = by_kind(docs, "Deployment")["rel-baton-redis"]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "rel-baton-redis-data"}} \
        in spec["volumes"]
    assert "--appendonly yes" in c["args"][0]
    assert "PersistentVolumeClaim" not in {d["kind"] for d in render(helm, None)}
    data = tmp_path / "data"
    data.mkdir()
    password = "Pw" + os.urandom(12).hex()
    proc, client = run_redis_container(c, tmp_path, password, data)
    client.set("baton:worker:w", "entry")
    for _ in range(100):  # fsync every second: until the AOF has it
        if any(b"baton:worker:w" in f.read_bytes() for f in data.rglob("*") if f.is_file()):
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait(30)
    proc, client = run_redis_container(c, tmp_path, password, data)
    try:
        assert client.get("baton:worker:w") == b"entry"
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_external_redis_behind_sentinel_is_taken(helm):
    docs = render(helm, None, "redis.enabled=false",
                  "redis.external.url=redis+sentinel://s-0:26379\\,s-1:26379/baton")
    assert "rel-baton-redis" not in by_kind(docs, "Deployment")
    env = worker_env(by_kind(docs, "Deployment")["rel-baton-decode"])
    assert env["BATON_REDIS_URL"]["value"] == "redis+sentinel://s-0:26379,s-1:26379/baton"


def pods(docs) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload the chart renders."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def mem_mi(q: str) -> float:
    units = {"Mi": 1, "Gi": 1024, "Ki": 1 / 1024}
    return float(q[:-2]) * units[q[-2:]]


def test_worker_memory_follows_the_model(helm):
    """weightsGb + kvCacheGb (CPU) or host tier (GPU, default 4) + overhead, as request and
    limit; a pool whose resources name memory keeps its own."""
    deps = by_kind(render(helm, None), "Deployment")
    for role in ("prefill", "decode"):
        res = deps[f"rel-baton-{role}"]["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"] == "3687Mi"  # 0.6 + 1 + 2
        assert res["requests"]["cpu"] == "2"
    gpu = by_kind(render(helm, VALUES["gpu-pools"]), "Deployment")
    dec = gpu["rel-baton-decode"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    # an 8B bf16 model: 16 GiB of weights + the 4 GiB host tier + 2: not the old 8 GiB default
    assert dec["limits"]["memory"] == dec["requests"]["memory"] == "22528Mi"
    pre = gpu["rel-baton-prefill"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert (pre["requests"]["memory"], pre["limits"]["memory"]) == ("64Gi", "96Gi")  # its own
    big = by_kind(render(helm, VALUES["gpu-pools"], "decode.kvTiers.hostGb=32",
                         "model.weightsGb=140.5"), "Deployment")["rel-baton-decode"]
    limit = big["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert mem_mi(limit) == (140.5 + 32 + 2) * 1024
    out = subprocess.run([helm, "template", "rel", str(CHART), *IMAGE, "--set",
                          "model.weightsGb=-1"], capture_output=True, text=True)
    assert out.returncode != 0 and "weightsGb" in out.stderr


def test_a_cpu_pools_kv_cache_gb_sizes_its_workers_pool(helm):
    """The memory the chart reserves for a CPU pool's KV pool (kvCacheGb) is the pool its
    workers allocate (--kv-cache-gb); numBlocks, where set, sizes it instead, and a GPU pool's
    is what its memory share leaves."""
    def args(*sets, values=None):
        deps = by_kind(render(helm, values, *sets), "Deployment")
        return {r: deps[f"rel-baton-{r}"]["spec"]["template"]["spec"]["containers"][0]["args"]
                for r in ("prefill", "decode")}

    got = args("decode.kvCacheGb=3.5", "prefill.numBlocks=900")
    assert got["decode"][got["decode"].index("--kv-cache-gb") + 1] == "3.5"
    assert "--num-blocks" not in got["decode"]
    assert got["prefill"][got["prefill"].index("--num-blocks") + 1] == "900"
    assert "--kv-cache-gb" not in got["prefill"]
    gpu = args(values=VALUES["gpu-pools"])
    assert all("--kv-cache-gb" not in a for a in gpu.values())


@pytest.mark.parametrize("name", VALUES)
def test_every_pod_runs_non_root_without_privileges_on_a_read_only_root(helm, name):
    docs = render(helm, VALUES[name])
    for pname, pod in pods(docs):
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, pname
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, pname
        for c in pod.get("initContainers", []) + pod["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, (pname, c["name"])
            assert csc["readOnlyRootFilesystem"] is True, (pname, c["name"])
            assert csc["capabilities"]["drop"] == ["ALL"], (pname, c["name"])
            assert "add" not in csc["capabilities"], (pname, c["name"])


def test_baton_processes_write_only_to_their_writable_volumes(helm):
    """With the root read-only, HOME, the Baton cache and Triton's cache sit on emptyDirs; the
    workers' cache is seeded from the image's (the converted model and kernels)."""
    docs = render(helm, VALUES["slo-autoscaler"])
    for pname, pod in pods(docs):
        c = pod["containers"][0]
        if c["name"] == "redis":
            assert {m["mountPath"] for m in c["volumeMounts"]} == {"/run/redis"}
            continue
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for var in ("HOME", "BATON_CACHE_DIR", "TRITON_CACHE_DIR"):
            under = [m for m in mounts if env[var] == m or env[var].startswith(m + "/")]
            assert under and "emptyDir" in volumes[mounts[under[0]]], (pname, var)
        if c["name"] in ("prefill", "decode"):
            (seed,) = pod["initContainers"]
            assert "cp -a /var/cache/baton/. /seed/" in seed["command"][-1]
            assert seed["volumeMounts"] == [{"name": "cache", "mountPath": "/seed"}]
            assert seed["image"] == c["image"]


def test_every_worker_pod_has_a_memory_backed_dev_shm(helm):
    for name in VALUES:
        deps = by_kind(render(helm, VALUES[name]), "Deployment")
        for role in ("prefill", "decode"):
            pod = deps[f"rel-baton-{role}"]["spec"]["template"]["spec"]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0][
                "volumeMounts"], (name, role)
            dshm = {v["name"]: v for v in pod["volumes"]}["dshm"]
            assert dshm["emptyDir"]["medium"] == "Memory", (name, role)


def test_the_rdma_profile_requests_devices_and_locked_memory(helm):
    base = VALUES["gpu-pools"]
    deps = by_kind(render(helm, base, "rdma.enabled=true", "decode.ucx.tls="), "Deployment")
    for role in ("prefill", "decode"):
        pod = deps[f"rel-baton-{role}"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
        assert c["resources"]["requests"]["rdma/hca_shared_devices_a"] == 1
        # non-root (the default): the runtime's memlock limit must be unlimited; no IPC_LOCK,
        # which would do nothing for a non-root user
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert "add" not in c["securityContext"]["capabilities"]
    # the pool's own ucx.tls wins; the profile's fills in where a pool names none
    assert worker_env(deps["rel-baton-prefill"])["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc"
    assert worker_env(deps["rel-baton-decode"])["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc"
    root = by_kind(render(helm, base, "rdma.enabled=true", "rdma.runAsRoot=true",
                          "rdma.ucxTls=rc_x\\,cuda_copy", "decode.ucx.tls="), "Deployment")
    pod = root["rel-baton-decode"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 0
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                                       "add": ["IPC_LOCK"]}
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert worker_env(root["rel-baton-decode"])["UCX_TLS"]["value"] == "rc_x,cuda_copy"
    router = root["rel-baton-router"]["spec"]["template"]["spec"]  # only the workers are root
    assert router["securityContext"]["runAsNonRoot"] is True
    off = by_kind(render(helm, base), "Deployment")["rel-baton-decode"]["spec"]["template"]
    assert not any(k.startswith("rdma/") for k in
                   off["spec"]["containers"][0]["resources"]["limits"])


def test_the_image_must_be_named(helm):
    """No image is published: without image.repository and image.tag the chart refuses to
    render instead of pulling a tag that does not exist."""
    out = subprocess.run([helm, "template", "rel", str(CHART)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "/image/repository" in out.stderr and "/image/tag" in out.stderr
    out = subprocess.run([helm, "template", "rel", str(CHART), "--set",
                          "image.repository=r.example/baton"], capture_output=True, text=True)
    assert out.returncode != 0 and "/image/tag" in out.stderr
    docs = render(helm, None)
    assert {c["image"] for _, p in pods(docs) for c in p["containers"] if c["name"] != "redis"} \
        == {"registry.example.com/baton:0.1.0-cpu"}


# Prometheus Operator's and KEDA's custom resources: no schema ships with Kubernetes' own, so
# these kinds are checked by the tests above only (listed, not silently skipped)
UNVALIDATED = {"ServiceMonitor", "PodMonitor", "ScaledObject"}
KUBERNETES = "1.33"  # the oldest Kubernetes the chart targets (native gRPC probes: 1.27)


@pytest.mark.parametrize("name", VALUES)
def test_every_manifest_validates_offline_against_the_kubernetes_schemas(helm, name):
    """Each rendered manifest of each values file against Kubernetes' OpenAPI schemas (strict:
    an unknown field fails), offline, with kubernetes-validate's bundled schemas."""
    import kubernetes_validate

    checked = set()
    for doc in render(helm, VALUES[name], *(["otel.enabled=true",
                                             "otel.endpoint=http://c:4317"]
                                            if name == "defaults" else [])):
        if doc["kind"] in UNVALIDATED:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}")
        checked.add(doc["kind"])
    assert {"Deployment", "Service"} <= checked
