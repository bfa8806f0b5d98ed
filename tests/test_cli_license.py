"""The licence pyproject.toml names is in the repository."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_license_file_matches_pyproject():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    assert 'license = { text = "MIT" }' in (REPO / "pyproject.toml").read_text()
