"""The Lennard-Jones demo (python -m chemtrain.demo) runs end to end (shortened)."""
import json
import os
import subprocess
import sys


def test_demo_runs(tmp_path):
    env = dict(os.environ, XLA_FLAGS="")  # one device: 'auto' resolves to single
    out = subprocess.run([sys.executable, "-m", "chemtrain.demo", "--epochs", "2", "--frames", "48",
                          "--batch", "8", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "force MAE" in out.stdout and "kJ/mol/nm" in out.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]
    assert (tmp_path / "losses.png").stat().st_size > 0
    assert (tmp_path / "checkpoints" / "epoch_00002.npz").exists()
    assert "epoch 1: train loss" in out.stdout
