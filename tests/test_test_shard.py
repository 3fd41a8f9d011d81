"""The SPRNN_TEST_SHARD split (tests/conftest.py) that lets one GPU test run span device calls."""

import pytest
from conftest import keep_shard


class FakeConfig:
    """Records what the hook reports as deselected."""

    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected.extend(items)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_cover_every_test_once(monkeypatch, n):
    tests = [f"t{i}" for i in range(23)]
    kept = []
    for k in range(1, n + 1):
        monkeypatch.setenv("SPRNN_TEST_SHARD", f"{k}/{n}")
        items, config = list(tests), FakeConfig()
        keep_shard(config, items)
        assert sorted(items + config.deselected) == sorted(tests)
        kept += items
    assert sorted(kept) == sorted(tests)


def test_no_shard_keeps_everything(monkeypatch):
    monkeypatch.delenv("SPRNN_TEST_SHARD", raising=False)
    items = ["a", "b"]
    keep_shard(FakeConfig(), items)
    assert items == ["a", "b"]


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_bad_shard_is_a_usage_error(monkeypatch, bad):
    monkeypatch.setenv("SPRNN_TEST_SHARD", bad)
    with pytest.raises(pytest.UsageError, match="SPRNN_TEST_SHARD"):
        keep_shard(FakeConfig(), ["a"])
