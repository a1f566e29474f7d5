"""deploy/k8s: every manifest validates (strictly, offline) against the bundled Kubernetes schemas of
``kubernetes-validate``, the topology is what SPEC §5.4 asks for, and the ConfigMap's Hydra overrides
compose with the project's config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from calib.config import compose

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the `dev` extra

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
VERSION = kubernetes_validate.latest_version()


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
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
