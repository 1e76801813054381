"""Session-wide test settings: per-user state goes to a temporary directory, never to the real home."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_state_dir(tmp_path_factory):
    previous = os.environ.get("COLIBRI_STATE_DIR")
    os.environ["COLIBRI_STATE_DIR"] = str(tmp_path_factory.mktemp("colibri-state"))
    yield
    if previous is None:
        os.environ.pop("COLIBRI_STATE_DIR", None)
    else:
        os.environ["COLIBRI_STATE_DIR"] = previous
