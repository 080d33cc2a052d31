"""The ``list`` command (fedjax_fair/cli/listing.py), run in-process."""

from fedjax_fair import cli
from fedjax_fair.algorithms import ALGORITHMS
from fedjax_fair.data import DATASETS
from fedjax_fair.core.execution import STRATEGIES
from fedjax_fair.metrics import METRICS
from fedjax_fair.models import MODELS
from fedjax_fair.scenarios.sampling import SAMPLERS


def test_list_prints_every_registry_entry(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for names in (ALGORITHMS, DATASETS, MODELS, STRATEGIES, SAMPLERS, METRICS):
        for name in names:
            assert name in out
    assert "mu: float = 0.01 in [0, inf), differentiable" in out  # type, default, range
    assert "server_lr: Rate = 0.01 in (0, inf)" in out  # FedAdam's own
    assert "qp_iters: int = 200 in integer 0..inf" in out  # a static count
    assert "full participation" in out  # AAggFF-S
    assert "  qffl  [fair aggregation]" in out  # each method's family, as compare groups them
    assert "num_clients=" in out  # dataset arguments


def test_list_shows_partitions(capsys):
    from fedjax_fair.data import PARTITIONERS
    assert cli.main(["list", "partitions"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PARTITIONERS) and "shards_per_client=2" in out


def test_list_one_section(capsys):
    assert cli.main(["list", "models"]) == 0
    out = capsys.readouterr().out
    assert "logreg" in out and "fedavg" not in out


# Gradient clipping and the client optimizer: every method that trains locally.
CLIP_LINE = "clip_norm: Optional[float] = None in (0, inf) or None, differentiable"


def test_list_shows_the_local_training_options_of_every_method_that_trains_locally(capsys):
    assert cli.main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    sections = {}
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            sections[name] = []
        elif line.startswith("      ") and sections:
            sections[name].append(line.strip())
    assert set(sections) == set(ALGORITHMS)
    for name, lines in sections.items():
        trains_locally = name != "fedevg"  # FedEvg: SGLD on synthetic data, its own clips
        assert (CLIP_LINE in lines) == trains_locally, name
        assert ("clip_mode: str = 'step'" in lines) == trains_locally, name
        objects = next((l for l in lines if l.startswith("Python API only:")), "")
        assert ("client_optimizer" in objects) == trains_locally, name


def test_list_shows_the_privacy_and_robustness_options(capsys):
    from fedjax_fair.cli import transforms
    from fedjax_fair.cli import parsing
    assert cli.main(["list", "robustness"]) == 0
    out = capsys.readouterr().out
    for name in (*transforms.ATTACKS, *parsing.ROBUST, "--dp-noise", "--dp-epsilon"):
        assert name in out
