"""The resume checkpoint (gpulayer/torch/resume.py): a fit run as a job saves at the step boundary after a
SIGTERM and stops; the next run of the same script resumes there, mid-epoch, and ends with the weights
of the uninterrupted run. Each run is a real process (resumable_fit.py) signalled for real; no peer."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("resumable_fit.py")


def run(folder: Path, *args: str, job: bool = True, restarts: int = 0) -> subprocess.CompletedProcess:
    folder.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    if job:
        env.update(GPULAYER_JOB_ID="0123456789ab-1", GPULAYER_RESTARTS=str(restarts))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def trained(folder: Path) -> tuple[dict, list[str]]:
    """The final weights and the (epoch, batch) of every batch trained, in order."""
    return torch.load(folder / "weights.pt"), (folder / "batches").read_text().splitlines()


def test_a_sigterm_saves_at_the_next_step_boundary_and_the_restart_resumes_there_exactly(tmp_path):
    straight = run(tmp_path / "straight", job=False)
    assert straight.returncode == 0, straight.stderr
    weights, batches = trained(tmp_path / "straight")
    assert len(batches) == 36

    job = tmp_path / "job"
    first = run(job, "--signal-at", "8", "--signal", "SIGTERM")  # as the first batch of step 8 begins
    assert first.returncode == 128 + signal.SIGTERM, first.stderr
    assert "saved" in first.stdout and "step 9;" in first.stdout  # after step 8 ended, its 2 batches done
    assert (job / "checkpoints" / "resume.ckpt").is_file() and not (job / "weights.pt").exists()
    done_before = (job / "batches").read_text().splitlines()
    assert done_before == batches[:18]  # epoch 0's 12 batches, and 6 of epoch 1

    again = run(job, restarts=1)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "epoch 1, step 9, batch 6" in again.stdout
    resumed, all_batches = trained(job)
    assert all_batches == batches  # each batch trained once, in the same order: none lost, none repeated
    assert resumed.keys() == weights.keys()
    assert all(torch.allclose(resumed[k], weights[k], rtol=0, atol=0) for k in weights)
    assert not (job / "checkpoints" / "resume.ckpt").exists()  # the fit ended: its resume checkpoint went


def test_after_a_sigkill_the_restart_resumes_from_the_last_periodic_save(tmp_path):
    straight = run(tmp_path / "straight", job=False)
    assert straight.returncode == 0, straight.stderr
    weights, batches = trained(tmp_path / "straight")

    job = tmp_path / "job"
    killed = run(job, "--every", "4", "--signal-at", "10", "--signal", "SIGKILL")
    assert killed.returncode == -signal.SIGKILL
    again = run(job, "--every", "4", restarts=1)
    assert again.returncode == 0, again.stderr
    assert "epoch 1, step 8, batch 4" in again.stdout  # the save of step 8; steps 8 and 9 are trained again
    resumed, all_batches = trained(job)
    assert all_batches == batches[:21] + batches[16:]  # up to the batch it died in, then from step 8 on
    assert all(torch.allclose(resumed[k], weights[k], rtol=0, atol=0) for k in weights)


def test_outside_a_job_nothing_is_saved_and_a_sigterm_ends_the_fit_at_once(tmp_path):
    ended = run(tmp_path / "plain", "--signal-at", "8", "--signal", "SIGTERM", job=False)
    assert ended.returncode == -signal.SIGTERM
    assert not (tmp_path / "plain" / "checkpoints").exists()
