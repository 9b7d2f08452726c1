"""sites.executors.slurm.unreachable: which sbatch refusals are the site's Slurm being unusable
(counted against the site: broker.leader.start_backoff) and which are the job's own request
(retried elsewhere, never backing the site off for everyone)."""

from __future__ import annotations

import pytest

from sites.executors.slurm import unreachable


@pytest.mark.parametrize(
    ("error", "site"),
    [
        ("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
         "(connect failure)", True),
        ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
         True),
        ("sbatch: error: Could not establish a configuration source", True),
        ("sbatch: error: s_p_parse_file: unable to status file /etc/slurm/slurm.conf: "
         "No such file or directory", True),
        ("sbatch: error: Batch job submission failed: Requested node configuration is not "
         "available", False),
        ("sbatch: error: Batch job submission failed: Invalid account or account/partition "
         "combination specified", False),
        ("sbatch: error: QOSMaxSubmitJobPerUserLimit", False),
    ],
)  # fmt: skip
def test_only_an_unusable_slurm_counts_against_the_site(error: str, site: bool) -> None:
    assert unreachable(error) is site
