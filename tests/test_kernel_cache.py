"""The C kernel cache and the prebuilt kernel directory (target_service/cbuild.py):
a library is loaded only from a directory nobody else can write, and only
when its bytes match the SHA-256 recorded when it was built; concurrent
builds never expose a half-written library; a prebuilt directory
(``python -m target_service.cbuild build DIR``, what the image ships) makes
bf16w and kquant eligible on a machine without a C compiler."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from target_service import cbuild

REPO = Path(__file__).resolve().parent.parent

needs_cc = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or cbuild.compiler() is None,
    reason="the kernels are x86-64 only and these tests compile them",
)

FLAGS = ("-O1", "-fPIC", "-shared")
GOOD = cbuild.Kernel("cachetest", "int specdec_cachetest(void) { return 7; }\n", FLAGS)


def planted_source(marker: Path) -> str:
    """A library that proves it was loaded: its constructor writes ``marker``."""
    return (
        "#include <stdio.h>\n"
        "int specdec_cachetest(void) { return 666; }\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("pwned", f); fclose(f); }}\n'
        "}\n"
    )


def plant(path: Path, marker: Path, tmp: Path, *, with_digest: bool) -> None:
    """Compiles the planted library to ``path`` (an attacker's file), with a
    matching digest sidecar when ``with_digest`` (one who can write the directory)."""
    src = tmp / "planted.c"
    src.write_text(planted_source(marker))
    subprocess.run(["cc", *FLAGS, "-o", str(path), str(src)], check=True, capture_output=True)
    if with_digest:
        import hashlib

        path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest() + "\n")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty specdec cache dir for this test; returns its kernels dir."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cbuild.KERNEL_DIR_ENV, raising=False)
    monkeypatch.setattr(cbuild, "_private", None)
    return tmp_path / "cache" / "kernels"


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """The captured records' messages with their structured fields."""
    return "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)


def value(dll: object) -> int:
    return int(dll.specdec_cachetest())  # type: ignore[attr-defined]


@needs_cc
def test_the_cache_is_private_and_each_library_has_its_digest(cache: Path) -> None:
    dll, why = cbuild.load(GOOD)
    assert why == "" and value(dll) == 7
    assert cache.is_dir() and (cache.stat().st_mode & 0o777) == 0o700
    lib = cache / GOOD.filename
    import hashlib

    assert (lib.parent / (lib.name + ".sha256")).read_text().split()[0] == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert not [p for p in cache.iterdir() if p.name.startswith(f".{GOOD.name}.")]  # no temporaries left


@needs_cc
def test_a_planted_library_with_a_wrong_digest_is_not_loaded(cache: Path, tmp_path: Path) -> None:
    assert value(cbuild.load(GOOD)[0]) == 7
    marker = tmp_path / "marker"
    plant(cache / GOOD.filename, marker, tmp_path, with_digest=False)  # the old sidecar stays
    dll, why = cbuild.load(GOOD)
    assert why == "" and value(dll) == 7  # rebuilt from the source
    assert not marker.exists()  # the planted library's code never ran
    # a planted library without any sidecar is not loaded either
    (cache / (GOOD.filename + ".sha256")).unlink()
    plant(cache / GOOD.filename, marker, tmp_path, with_digest=False)
    assert value(cbuild.load(GOOD)[0]) == 7 and not marker.exists()


@needs_cc
def test_a_cache_dir_others_can_write_is_refused(cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache.mkdir(parents=True)
    marker = tmp_path / "marker"
    plant(cache / GOOD.filename, marker, tmp_path, with_digest=True)  # a consistent pair, planted by another user
    os.chmod(cache, 0o777)
    caplog.set_level("WARNING", logger="specdec.target.kernels")
    dll, why = cbuild.load(GOOD)
    assert why == "" and value(dll) == 7 and not marker.exists()
    assert "refusing the kernel cache" in logged(caplog) and "0777" in logged(caplog)
    assert not (cache / ".lock").exists()  # nothing was written there


@needs_cc
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_dir_owned_by_another_user_is_refused(cache: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cache.mkdir(parents=True, mode=0o700)
    marker = tmp_path / "marker"
    plant(cache / GOOD.filename, marker, tmp_path, with_digest=True)
    os.chown(cache, 12345, 12345)
    caplog.set_level("WARNING", logger="specdec.target.kernels")
    dll, why = cbuild.load(GOOD)
    assert why == "" and value(dll) == 7 and not marker.exists()
    assert "owned by uid 12345" in logged(caplog)


@needs_cc
def test_concurrent_builds_all_load_a_whole_library(cache: Path) -> None:
    """Four processes build the same new kernel at once into one cache: each
    loads a library that passes its digest check (none sees a partial file)."""
    code = ("import sys; from target_service import cbuild; "
            f"k = cbuild.Kernel('cachetest', {GOOD.source!r}, {FLAGS!r}); d, why = cbuild.load(k); "
            "print(d.specdec_cachetest() if d else why)")
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache.parent), "PYTHONPATH": str(REPO)}
    env.pop(cbuild.KERNEL_DIR_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["7"] * 4, outs
    assert sorted(p.name for p in cache.iterdir()) == [".lock", GOOD.filename, GOOD.filename + ".sha256"]


def _no_compiler_env(tmp_path: Path, kernel_dir: Path) -> dict[str, str]:
    """A target's environment without any C compiler, with a prebuilt kernel dir."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": str(empty), "CC": str(tmp_path / "no-such-cc"), "PYTHONPATH": str(REPO),
           "SPECDEC_CACHE_DIR": str(tmp_path / "fresh-cache"), cbuild.KERNEL_DIR_ENV: str(kernel_dir)}
    return env


CANDIDATES = """
import json, sys, torch
from pathlib import Path
from target_service import bf16w, cbuild, kquant
from target_service.calibration import resolve_pairs
assert cbuild.compiler() is None
pairs, how = resolve_pairs("auto", "auto", torch.device("cpu"), Path(sys.argv[1]))
print(json.dumps({"pairs": pairs, "how": how, "bf16w": bf16w.available()[1], "kquant": kquant.available()[1]}))
"""


def candidates(tmp_path: Path, kernel_dir: Path, gguf: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CANDIDATES, str(gguf)], env=_no_compiler_env(tmp_path, kernel_dir),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import TINY_CHARS
    from tests.gguf_tiny import quantize_tiny_model
    from tests.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("kq-model")
    hf = build_tiny_model(root / "hf", chars=TINY_CHARS, seed=21, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2)
    return quantize_tiny_model(hf, root / "model.gguf")


@needs_cc
def test_a_prebuilt_kernel_dir_makes_bf16w_and_kquant_eligible_without_a_compiler(tmp_path: Path,
                                                                                   kquant_gguf: Path) -> None:
    """What the image does (docker/Dockerfile): the kernels built in the
    builder stage, no compiler at run time. The calibration candidates on this
    CPU include bf16w and kquant; a tampered library is skipped."""
    from target_service.backends import cpu_info

    flags = set(cpu_info().flags)
    if not {"avx2", "fma"} <= flags:
        pytest.skip("bf16w and kquant need AVX2 + FMA")
    kdir = tmp_path / "kernels"
    out = subprocess.run([sys.executable, "-m", "target_service.cbuild", "build", str(kdir)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    built = sorted(p.name for p in kdir.glob("*.so"))
    assert [n.split("-")[0] for n in built] == ["bf16w", "kquant", "kquant"]  # every ISA build of kquant
    got = candidates(tmp_path, kdir, kquant_gguf)
    assert ["bfloat16", "bf16w"] in got["pairs"] and ["bfloat16", "kquant"] in got["pairs"], got
    assert got["how"] == "calibration"
    # without the prebuilt dir there is nothing to load: both drop out, saying why
    got = candidates(tmp_path, tmp_path / "missing", kquant_gguf)
    assert ["bfloat16", "bf16w"] not in got["pairs"] and "no C compiler" in str(got["bf16w"])
    # a library whose bytes changed is not loaded
    (lib,) = kdir.glob("bf16w-*.so")
    data = bytearray(lib.read_bytes())
    data[-1] ^= 1
    lib.write_bytes(bytes(data))
    got = candidates(tmp_path, kdir, kquant_gguf)
    assert ["bfloat16", "bf16w"] not in got["pairs"] and "SHA-256" in str(got["bf16w"]), got
    assert ["bfloat16", "kquant"] in got["pairs"]
    # a prebuilt dir that others can write is not trusted at all
    os.chmod(kdir, 0o777)
    got = candidates(tmp_path, kdir, kquant_gguf)
    assert ["bfloat16", "kquant"] not in got["pairs"] and "0777" in str(got["kquant"]), got


def test_the_images_build_and_ship_the_kernels() -> None:
    """scripts/check_docker.sh's static check passes on both Dockerfiles, and
    fails on a runtime stage that lacks the kernel dir or SPECDEC_KERNEL_DIR."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_kernels", REPO / "scripts" / "check_dockerfile_kernels.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    sys.modules["check_kernels"] = check  # dataclasses look their module up
    spec.loader.exec_module(check)
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (REPO / "docker" / name).read_text()
        assert check.problems(text) == [], name
        assert "RUN python -m target_service.cbuild build /opt/specdec/kernels" in text
        no_env = text.replace("SPECDEC_KERNEL_DIR=/opt/specdec/kernels", "SPECDEC_OTHER=1")
        assert [p for p in check.problems(no_env) if "does not set SPECDEC_KERNEL_DIR" in p], name
        no_copy = text.replace("COPY --from=build /opt/specdec/kernels /opt/specdec/kernels", "")
        assert [p for p in check.problems(no_copy) if "does not copy the kernel dir" in p], name
        no_build = text.replace("RUN python -m target_service.cbuild build /opt/specdec/kernels", "")
        assert check.problems(no_build) == ["no stage runs `python -m target_service.cbuild build DIR`"]
    out = subprocess.run(["bash", str(REPO / "scripts" / "check_docker.sh")], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    if "hadolint missing" not in out.stderr:
        assert out.returncode == 0, out.stderr
