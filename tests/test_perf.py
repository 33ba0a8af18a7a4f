"""Performance paths that must not change numerics: the chunked vocab-parallel loss on the 2×2 mesh
(tests/workers/perf_mesh.py, 4 gloo processes)."""

from __future__ import annotations

from helpers import ROOT, torchrun


def test_chunked_loss_matches_the_unchunked_loss_and_gradients_on_2x2(tmp_path):
    done = tmp_path / "done"
    result = torchrun(4, str(ROOT / "tests" / "workers" / "perf_mesh.py"), "--done", str(done), timeout=300)
    assert result.returncode == 0 and done.exists(), result.stdout[-6000:]
