"""Fixtures of the tracker tests (tests/training/test_trackers.py, test_vlm.py): no network, wandb offline and
trackio's local store under tmp_path."""

import ipaddress
import socket
import sys

import pytest


@pytest.fixture
def no_network(monkeypatch):
    """Connections from Python to anything but this machine are refused and fail the test."""
    refused, connect = [], socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                local = ipaddress.ip_address(address[0]).is_loopback
            except ValueError:
                local = address[0] == "localhost"
            if not local:
                refused.append(address)
                raise OSError(f"test_trackers: no network ({address})")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert not refused


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch, no_network):
    """wandb offline, its run, cache, config and artifact folders under tmp_path; the run is closed and wandb's
    service stopped afterwards."""
    import wandb

    root = tmp_path / "wandb"
    folders = dict(DIR=root, CACHE_DIR=root / "cache", CONFIG_DIR=root / "config", DATA_DIR=root / "data")
    for name, folder in {**folders, "ARTIFACT_DIR": root / "artifacts"}.items():
        monkeypatch.setenv(f"WANDB_{name}", str(folder))
    for name, value in dict(MODE="offline", SILENT="true", CONSOLE="off", ERROR_REPORTING="false").items():
        monkeypatch.setenv(f"WANDB_{name}", value)
    monkeypatch.setenv("WANDB_PROJECT", "trl-es-trackers")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    yield root
    wandb.finish()
    wandb.teardown()


@pytest.fixture
def trackio_store(tmp_path, monkeypatch, no_network):
    """trackio's local store under tmp_path, no Space or server named. trackio reads TRACKIO_DIR once, at import, into
    constants of its modules (another test may have imported it already), so those are pointed there too."""
    root = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(root))
    for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    import trackio  # noqa: F401

    folders = {"TRACKIO_DIR": root, "MEDIA_DIR": root / "media", "ARTIFACTS_DIR": root / "artifacts"}
    for name, module in list(sys.modules.items()):
        if name == "trackio" or name.startswith("trackio."):
            for constant, folder in folders.items():
                if hasattr(module, constant):
                    monkeypatch.setattr(module, constant, folder)
    return root
