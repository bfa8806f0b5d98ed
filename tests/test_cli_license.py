"""The licence pyproject.toml names is in the repository, and the built packages declare it in
the current form (PEP 639, setuptools >= 77): ``license = "MIT"`` (an SPDX expression) with
``license-files``, so the metadata has ``License-Expression`` and the file, and the build warns
of nothing about it (the table form ``license = {text = ...}`` is deprecated)."""
import email
import tarfile
import zipfile

import pytest
from source_copy import REPO, build, clone


def test_license_file_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert cfg["project"]["license"] == "MIT"
    assert cfg["project"]["license-files"] == ["LICENSE"]
    # the SPDX form needs setuptools 77: build isolation fetches it, the test extra (the
    # environment of --no-build-isolation installs, tests/test_install.py) asks for it
    assert "setuptools>=77" in cfg["build-system"]["requires"]
    assert "setuptools>=77" in cfg["project"]["optional-dependencies"]["test"]


def _no_license_warning(log: str) -> None:
    bad = [line for line in log.splitlines() if "licen" in line.lower() and ("deprecat" in line.lower()
                                                                            or "warn" in line.lower())]
    assert not bad, bad


def test_built_packages_declare_the_license(tmp_path):
    src = clone(tmp_path / "src")
    wheel, log = build("wheel", src, tmp_path / "dist")
    _no_license_warning(log)
    with zipfile.ZipFile(wheel) as z:
        info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
        assert z.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    assert meta.get_all("License-Expression") == ["MIT"]
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta.get("License") is None   # the table form's field
    sdist, log = build("sdist", src, tmp_path / "dist")
    _no_license_warning(log)
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        meta = email.message_from_bytes(t.extractfile(f"{top}/PKG-INFO").read())
        assert t.extractfile(f"{top}/LICENSE").read() == (REPO / "LICENSE").read_bytes()
    assert meta.get_all("License-Expression") == ["MIT"]
    assert meta.get_all("License-File") == ["LICENSE"]
