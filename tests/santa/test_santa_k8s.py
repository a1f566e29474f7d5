"""deploy/k8s: every manifest validates (strictly, offline) against the bundled Kubernetes schemas of
``kubernetes-validate``, the topology is the worker/aggregator design's, every pod is locked down (non-root,
read-only root filesystem, no capabilities, seccomp, CPU and memory bounds), only the aggregator reaches
MLflow and MLflow wants a password; the ConfigMap's Hydra overrides compose with the project's config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from calib.config import compose

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the `dev` extra

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
EXAMPLES = sorted(K8S.glob("examples/*.yaml"))  # templates a user fills in; kustomize applies none
VERSION = kubernetes_validate.latest_version()


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


def _examples() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in EXAMPLES for d in _docs(p)}


@pytest.mark.parametrize("path", MANIFESTS + EXAMPLES, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path):
    for doc in _docs(path):
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises on any schema violation


@pytest.mark.parametrize("mutation", ["unknown_field", "wrong_type", "bad_access_mode"])
def test_schema_validation_catches_mistakes(mutation):
    docs = _all()
    if mutation == "bad_access_mode":
        doc = copy.deepcopy(docs[("PersistentVolumeClaim", "santa-shared")])
        doc["spec"]["accessModes"] = "ReadWriteMany"  # a string, not a list
    else:
        doc = copy.deepcopy(docs[("Deployment", "santa-aggregator")])
        if mutation == "unknown_field":
            doc["spec"]["replica"] = 1
        else:
            doc["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)


def _pod(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]


def _claims(deploy: dict) -> dict[str, str]:
    """volume name -> PVC claim name"""
    return {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in _pod(deploy)["volumes"]
            if "persistentVolumeClaim" in v}


def _mounts(deploy: dict) -> dict[str, str]:
    """mount path -> volume name (first container)"""
    return {m["mountPath"]: m["name"] for m in _pod(deploy)["containers"][0]["volumeMounts"]}


def test_topology_matches_the_spec():
    docs = _all()
    shared = docs[("PersistentVolumeClaim", "santa-shared")]
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"]
    agg, worker, mlflow = (docs[("Deployment", n)] for n in ("santa-aggregator", "santa-worker", "mlflow"))
    assert agg["spec"]["replicas"] == 1 and agg["spec"]["strategy"]["type"] == "Recreate"
    assert "python -m calib aggregator" in " ".join(_pod(agg)["containers"][0]["args"])
    assert "python -m calib worker" in " ".join(_pod(worker)["containers"][0]["args"])
    res = _pod(worker)["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "1" and res["requests"]["nvidia.com/gpu"] == "1"
    for d in (agg, worker):  # both mount the shared volume where the ConfigMap's rl.dir points
        assert _claims(d)[_mounts(d)["/shared"]] == "santa-shared"
    assert not any(e["name"].startswith("MLFLOW") for e in _pod(worker)["containers"][0].get("env", []))
    # MLflow: SQLite on its own ReadWriteOnce volume, never on the shared one
    args = _pod(mlflow)["containers"][0]["args"]
    db = next(a.split("sqlite:///", 1)[1] for a in args if a.startswith("--backend-store-uri=sqlite:///"))
    mount = next(m for m in _mounts(mlflow) if db.startswith(m.rstrip("/") + "/"))
    claim = _claims(mlflow)[_mounts(mlflow)[mount]]
    assert claim != "santa-shared"
    assert docs[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert mlflow["spec"]["replicas"] == 1 and mlflow["spec"]["strategy"]["type"] == "Recreate"
    service = docs[("Service", "mlflow")]
    assert service["spec"]["selector"].items() <= _pod_labels(mlflow).items()
    assert service["spec"]["ports"][0]["port"] == 5000


def _pod_labels(deploy: dict) -> dict:
    return deploy["spec"]["template"]["metadata"]["labels"]


def test_references_resolve():
    docs = _all()
    for (kind, name), d in docs.items():
        if kind != "Deployment":
            continue
        assert d["spec"]["selector"]["matchLabels"].items() <= _pod_labels(d).items(), name
        for v in _pod(d)["volumes"]:
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in docs
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in docs
        volumes = {v["name"] for v in _pod(d)["volumes"]}
        assert set(_mounts(d).values()) <= volumes, name
        for c in _pod(d)["containers"]:  # every Secret key a pod reads is in the shipped template
            refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e]
            for ref in refs:
                assert ref["key"] in _examples()[("Secret", ref["name"])]["stringData"], (name, ref)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def _overrides() -> list[str]:
    text = _all()[("ConfigMap", "santa-overrides")]["data"]["overrides.txt"]
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_configmap_overrides_compose():
    overrides = _overrides()
    assert all(" " not in o for o in overrides)  # the pods word-split the file
    cfg = compose(["+method=santa", *overrides])
    assert cfg.method.name == "santa" and cfg.rl.dir == "/shared/santa-rl" and cfg.model.name == "llama31"
    assert cfg.tracking.uri == "http://mlflow:5000"  # the Service above


def test_santa_method_config_defaults():
    cfg = compose(["+method=santa"])
    assert (cfg.method.estimator, cfg.method.tiling, cfg.method.tile) == ("sys", "flash", 256)
    rl = cfg.rl
    # the CPU default run is sized for 3 minutes (5 episodes of 12 questions per batch); the cluster run
    # sets App. L's ten episodes of 16 questions itself
    assert (rl.budget_per_layer, rl.episodes, rl.questions_per_episode, rl.lr) == (8, 5, 12, 0.02)
    assert rl.workers >= 1 and rl.iterations >= 1 and "dir" in rl
    cluster = compose(["+method=santa", *_overrides()]).rl
    assert (cluster.episodes, cluster.questions_per_episode) == (10, 16)


# ---------------------------------------------------------------------------------- hardening
def _deployments() -> dict[str, dict]:
    return {name: d for (kind, name), d in _all().items() if kind == "Deployment"}


def _containers(deploy: dict) -> list[dict]:
    pod = _pod(deploy)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _writable_dirs(deploy: dict, container: dict) -> list[str]:
    """Mount paths ``container`` may write: emptyDir or PVC volumes not mounted read-only."""
    kinds = {v["name"]: v for v in _pod(deploy)["volumes"]}
    return [m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")
            and ("emptyDir" in kinds[m["name"]] or "persistentVolumeClaim" in kinds[m["name"]])
            and not kinds[m["name"]].get("persistentVolumeClaim", {}).get("readOnly")]


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@pytest.mark.parametrize("name", sorted(_deployments()))
def test_every_pod_is_locked_down(name):
    deploy = _deployments()[name]
    pod = _pod(deploy)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False  # no pod calls the Kubernetes API
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in _containers(deploy):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged"), c["name"]
        assert sc.get("runAsNonRoot", pod["securityContext"]["runAsNonRoot"]) is True
        assert sc.get("seccompProfile", pod["securityContext"]["seccompProfile"]) == {"type": "RuntimeDefault"}
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][part]), (c["name"], part)
        writable = _writable_dirs(deploy, c)
        assert "/tmp" in writable and "emptyDir" in volumes[_mounts(deploy)["/tmp"]], c["name"]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for path in (env.get("HOME"), env.get("CALIB_HOME"), c.get("workingDir")):
            assert path is None or _under(path, writable), (c["name"], path)  # where caches and outputs go
        if "calib" in " ".join(c["args"]):  # calib writes its stores and caches under CALIB_HOME
            assert env.get("CALIB_HOME") and c.get("workingDir"), c["name"]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the checks below read matchLabels only
    return selector.get("matchLabels", {}).items() <= labels.items()


def _ingress_peers(labels: dict) -> tuple[bool, list[tuple[dict, list[dict] | None]]]:
    """(whether an Ingress NetworkPolicy selects pods with ``labels``, the (peer, ports) they admit)."""
    policies = [d for (kind, _), d in _all().items() if kind == "NetworkPolicy"
                and "Ingress" in d["spec"]["policyTypes"] and _selects(d["spec"]["podSelector"], labels)]
    peers = [(peer, rule.get("ports")) for p in policies for rule in p["spec"].get("ingress", [])
             for peer in rule.get("from", [{}])]  # a rule without `from` admits everyone: caught below
    return bool(policies), peers


def test_network_policy_admits_only_the_aggregator_to_mlflow():
    deployments = _deployments()
    for name, deploy in deployments.items():
        isolated, peers = _ingress_peers(_pod_labels(deploy))
        assert isolated, f"{name}: no NetworkPolicy denies ingress by default"
        admitted = set()
        for peer, ports in peers:
            assert set(peer) == {"podSelector"}, (name, peer)  # same namespace, no ipBlock, no everyone
            assert ports and all(p["port"] == 5000 and p["protocol"] == "TCP" for p in ports), (name, ports)
            admitted |= {n for n, d in deployments.items() if _selects(peer["podSelector"], _pod_labels(d))}
        # workers never talk to MLflow, so only the aggregator may: a subset of {aggregator, workers}
        assert admitted == ({"santa-aggregator"} if name == "mlflow" else set()), (name, admitted)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(container: dict, var: str) -> tuple[str, str]:
    entry = _env(container)[var]
    assert "value" not in entry, f"{var} is written into the manifest"
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_mlflow_requires_authentication():
    import configparser

    from mlflow.cli import server

    deployments = _deployments()
    mlflow, = _pod(deployments["mlflow"])["containers"]
    args = mlflow["args"]
    assert "--app-name=basic-auth" in args
    options = {o for p in server.params for o in p.opts}  # every flag exists in the installed mlflow
    assert {a.split("=", 1)[0] for a in args} <= options, sorted({a.split("=", 1)[0] for a in args} - options)
    assert "basic-auth" in next(p for p in server.params if "--app-name" in p.opts).type.choices
    # the auth config: a mounted ConfigMap; the user store on the server's own volume; strangers get nothing
    config_dir, config_file = _env(mlflow)["MLFLOW_AUTH_CONFIG_PATH"]["value"].rsplit("/", 1)
    volumes = {v["name"]: v for v in _pod(deployments["mlflow"])["volumes"]}
    config_map = volumes[_mounts(deployments["mlflow"])[config_dir]]["configMap"]["name"]
    ini = configparser.ConfigParser()
    ini.read_string(_all()[("ConfigMap", config_map)]["data"][config_file])
    assert ini["mlflow"]["default_permission"] == "NO_PERMISSIONS"
    users_db = ini["mlflow"]["database_uri"].removeprefix("sqlite:///")
    assert _under(users_db, [m for m in _mounts(deployments["mlflow"]) if m == "/mlflow"])
    assert "admin_password" not in ini["mlflow"]
    # admin and CSRF key from the Secret; the aggregator logs in as that user; workers get no credentials
    admin = _secret_ref(mlflow, "MLFLOW_AUTH_ADMIN_USERNAME"), _secret_ref(mlflow, "MLFLOW_AUTH_ADMIN_PASSWORD")
    _secret_ref(mlflow, "MLFLOW_FLASK_SERVER_SECRET_KEY")
    aggregator, = _pod(deployments["santa-aggregator"])["containers"]
    login = _secret_ref(aggregator, "MLFLOW_TRACKING_USERNAME"), _secret_ref(aggregator, "MLFLOW_TRACKING_PASSWORD")
    assert login == admin
    # the shipped Secret is a template: no value in it, and kustomize does not apply it
    secret = _examples()[("Secret", admin[0][0])]
    assert set(secret["stringData"].values()) == {""}
    assert ("Secret", admin[0][0]) not in _all()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, auth: tuple[str, str] | None = None, body: dict | None = None) -> int:
    import base64
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_mlflow_auth_config_refuses_strangers(tmp_path):
    """The ConfigMap's auth config on a real ``mlflow server --app-name basic-auth`` (needs ``mlflow[auth]``):
    /health answers anyone (the readiness probe), moving an alias without credentials is refused."""
    import os
    import subprocess
    import sys
    import time

    pytest.importorskip("flask_wtf")
    mlflow = _pod(_deployments()["mlflow"])["containers"][0]
    ini = _all()[("ConfigMap", "mlflow-auth-config")]["data"]["basic_auth.ini"]
    (tmp_path / "auth.ini").write_text(ini.replace("sqlite:////mlflow/", f"sqlite:///{tmp_path}/"))
    user, password, port = "calib", "a-test-password-0123", _free_port()
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "auth.ini"), "MLFLOW_AUTH_ADMIN_USERNAME": user,
           "MLFLOW_AUTH_ADMIN_PASSWORD": password, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-key",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    args = [a for a in mlflow["args"] if not a.startswith(("--backend-store-uri", "--artifacts-destination", "--host",
                                                             "--port"))]
    args += [f"--backend-store-uri=sqlite:///{tmp_path}/m.db", f"--artifacts-destination={tmp_path}/a",
             "--host=127.0.0.1", f"--port={port}"]
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", *args],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _status(f"{base}/health") == 200:
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        assert _status(f"{base}/health") == 200
        alias = {"name": "sale-tiny", "alias": "champion", "version": "1"}
        assert _status(f"{base}/api/2.0/mlflow/registered-models/alias", body=alias) == 401
        assert _status(f"{base}/api/2.0/mlflow/registered-models/alias", (user, "wrong"), alias) == 401
        create = f"{base}/api/2.0/mlflow/registered-models/create"
        assert _status(create, (user, password), {"name": "sale-tiny"}) == 200
    finally:
        from calib.ui import stop_group

        stop_group(proc.pid)
        proc.wait()
