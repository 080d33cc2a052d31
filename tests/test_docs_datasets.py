"""docs/datasets.md stays true: every command, model count and Python snippet in it works.

The page maps the experimental-setup tables of the implemented papers to
``fedjax-fair run`` / ``compare`` commands. Here

* every such command (backslash continuations joined, split with ``shlex``) goes through
  the CLI's own parser, ``config_from_args`` and ``validate_run`` / ``validate_compare``
  (flags, dataset arguments, model names and model arguments, without touching data);
* its model is built for the data set's real input shape (``jax.eval_shape``, no
  compute), so a network that cannot take those inputs fails;
* for TFDS-backed data sets the federation itself is built, with ``load_tfds`` replaced
  by label pools that have the real data sets' class counts (tiny inputs, no download):
  a partition that cannot be drawn (e.g. a per-class Dirichlet with more clients than it
  can feed) or a cohort larger than the federation fails;
* the parameter counts of the models table are recomputed;
* every Python snippet is executed, with the same stand-in loaders, and each function it
  defines is called.
"""
from __future__ import annotations

import functools
import json
import re
import shlex
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import config as C
from fedjax_fair.data import PARTITIONERS, builders, client_test, get_dataset, tfds_source
from fedjax_fair.models import get_model

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "datasets.md"
SPEC_DIR = ROOT.parent / "shared" / "spec"
SPECS = ("a_fedpd", "aaggff", "computational_heterogeneity", "dqn_fed", "fedevg", "superfed")
# How each paper's section of the page is headed: its arXiv id, or its venue / source.
PAPERS = {"a_fedpd": "arXiv:2409.18915", "aaggff": "arXiv:2405.20821",
          "computational_heterogeneity": "arXiv:2307.06283", "dqn_fed": "OpenReview KbteA50cni",
          "fedevg": "FedEvg (Hahn's PhD thesis", "superfed": "arXiv:2109.07628"}

# Per-class example counts of the real splits (MNIST's are the published class counts;
# the others are balanced). Tiny ImageNet's labelled evaluation split is "validation".
MNIST_TRAIN = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
MNIST_TEST = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)
POOLS = {  # tfds name -> (input shape, {split: per-class counts})
    "mnist": ((28, 28, 1), {"train": MNIST_TRAIN, "test": MNIST_TEST}),
    "fashion_mnist": ((28, 28, 1), {"train": (6000,) * 10, "test": (1000,) * 10}),
    "cifar10": ((32, 32, 3), {"train": (5000,) * 10, "test": (1000,) * 10}),
    "cifar100": ((32, 32, 3), {"train": (500,) * 100, "test": (100,) * 100}),
    "tiny_imagenet": ((64, 64, 3), {"train": (500,) * 200, "validation": (50,) * 200}),
    "cinic10": ((32, 32, 3), {"train": (9000,) * 10, "test": (9000,) * 10}),
    # Stand-in sizes (only the snippets use it): 62 classes, as emnist/byclass.
    "emnist/byclass": ((28, 28, 1), {"train": (300,) * 62, "test": (60,) * 62}),
}
# Input shape and classes of the LEAF data sets (for the model check only).
LEAF_SHAPES = {"femnist": ((28, 28, 1), 62), "shakespeare": ((80,), 80)}


# ----------------------------------------------------------------------------- parsing


def _doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def code_blocks(text: str, lang: str) -> list[str]:
    """Bodies of the fenced code blocks of ``text`` whose info string is ``lang``."""
    return re.findall(rf"^```{lang}[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def commands(text: str) -> list[str]:
    """Every ``fedjax-fair run`` / ``compare`` line of the fenced code blocks, with
    backslash line continuations joined into one line."""
    out = []
    for body in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        logical, buf = [], ""
        for line in body.splitlines():
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            logical.append(buf + line)
            buf = ""
        if buf:
            logical.append(buf)
        out += [" ".join(l.split()) for l in logical
                if re.match(r"\s*fedjax-fair (run|compare)\b", l)]
    return out


def test_command_extraction_joins_continuations():
    text = ("```bash\n# comment\nfedjax-fair run --dataset mnist \\\n    --num-clients 5\n"
            "echo fedjax-fair run\nfedjax-fair list\n```\n"
            "fedjax-fair run --outside-a-block\n"
            "```text\nfedjax-fair compare --seeds 0,1\n```\n")
    assert commands(text) == ["fedjax-fair run --dataset mnist --num-clients 5",
                              "fedjax-fair compare --seeds 0,1"]


DOC_COMMANDS = commands(_doc_text())


PARSER = cli.build_parser()


@functools.lru_cache(maxsize=None)
def _config(command: str):
    """The validated RunConfig / CompareConfig of one command, as ``cmd_run`` /
    ``cmd_compare`` build it (cached: the tests only read it)."""
    argv = shlex.split(command)
    assert argv[:1] == ["fedjax-fair"] and argv[1] in ("run", "compare"), command
    argv = [str(ROOT / a) if a.startswith("experiments/") else a for a in argv]  # repo-relative
    args = PARSER.parse_args(argv[1:])
    cls = C.RunConfig if argv[1] == "run" else C.CompareConfig
    cfg = cli.config_from_args(args, cls)
    if cls is C.RunConfig:
        C.validate_run(cfg)
    else:
        C.validate_compare(cfg)
    return cfg


def _cmd_id(command: str) -> str:
    m = re.search(r"(?:-o|--output-dir) (\S+)", command)
    return (("compare:" if " compare " in command else "") + m.group(1)) if m else command[:60]


# --------------------------------------------------------------------- coverage checks


def test_the_page_covers_every_spec_with_commands():
    text = _doc_text()
    found = sorted(p.stem for p in SPEC_DIR.glob("*.md")) if SPEC_DIR.is_dir() else []
    specs = sorted(set(SPECS) | set(found))
    sections = re.split(r"^## ", text, flags=re.M)
    for spec in specs:
        marker = PAPERS.get(spec)
        hits = [s for s in sections if marker and s.splitlines()[0].find(marker) >= 0]
        assert hits, f"no section of docs/datasets.md is headed with the {spec} paper ({marker})"
        body = hits[0]
        assert commands(body) or code_blocks(body, "python"), \
            f"the {spec} section has neither a command nor a Python recipe"
    assert len(DOC_COMMANDS) >= 55, len(DOC_COMMANDS)


def test_output_directories_are_distinct():
    outs = [_cmd_id(c) for c in DOC_COMMANDS]
    assert all(re.search(r"(-o|--output-dir) ", c) for c in DOC_COMMANDS)
    assert len(outs) == len(set(outs)), sorted(o for o in outs if outs.count(o) > 1)


# ------------------------------------------------------------------- commands validate


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # validate_* checks that the (relative) output directories could be created.
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=_cmd_id)
def test_command_is_valid(command):
    cfg = _config(command)
    if isinstance(cfg, C.RunConfig):
        assert cfg.algorithm in ("fedavg",), "the page runs the available FedAvg"
    key = cfg.dataset_args.get("tfds_name", cfg.dataset)
    shape, classes = (LEAF_SHAPES[key] if key in LEAF_SHAPES
                      else (POOLS[key][0], len(POOLS[key][1]["train"])))
    assert _num_params(cfg.model, shape, classes, _frozen(cfg.model_args)) > 0


def _frozen(d: dict) -> str:
    return json.dumps(d, sort_keys=True)


@functools.lru_cache(maxsize=None)
def _num_params(model: str, shape: tuple, classes: int, model_args: str) -> int:
    """Builds the model for ``shape`` / ``classes`` and counts parameters (eval_shape)."""
    m = get_model(model, shape, classes, **json.loads(model_args))
    shapes = jax.eval_shape(m.init, jax.random.key(0))
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(shapes)))


# --------------------------------------------------------- partitions on real class counts


def fake_load_tfds(name, split="train", **where):
    """``load_tfds`` on label pools with the real class counts and 1x1 images."""
    tfds_name = tfds_source.resolve_name(name)
    shape, splits = POOLS[tfds_name]
    counts = splits[split]
    rng = np.random.default_rng(len(tfds_name) * 7 + len(split))
    y = rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int32)
    x = np.full((y.size, 1, 1, shape[-1]), 0.5, np.float32)
    x[:, 0, 0, 0] = y / len(counts)  # inputs that follow their label
    return tfds_source.TfdsArrays(x=x, y=y, num_classes=len(counts),
                                  input_shape=x.shape[1:], name=tfds_name, extras={})


_FEDERATIONS: dict = {}


def _federation(cfg, monkeypatch):
    key = (cfg.dataset, _frozen(cfg.dataset_args))
    if key not in _FEDERATIONS:
        monkeypatch.setattr(tfds_source, "load_tfds", fake_load_tfds)
        _FEDERATIONS[key] = get_dataset(cfg.dataset, **cfg.dataset_args)
    return _FEDERATIONS[key]


TFDS_COMMANDS = [c for c in DOC_COMMANDS
                 if not re.search(r"--dataset (femnist|shakespeare|leaf)\b", c)]


def _pool(cfg, split_arg: str):
    key = cfg.dataset_args.get("tfds_name", cfg.dataset)
    split = cfg.dataset_args.get(split_arg, split_arg.split("_")[0])
    return fake_load_tfds(key, split)


_DRAWS: dict = {}


def _draw(cfg) -> tuple[list, list]:
    """(train parts, matched test parts or []) drawn as ``federate`` draws them."""
    key = (cfg.dataset, _frozen(cfg.dataset_args))
    if key not in _DRAWS:
        args = cfg.dataset_args
        name = args.get("partition", builders.COMMON_ARGS["partition"])
        seed = args.get("seed", 0)
        train = _pool(cfg, "train_split")
        kwargs = builders.partition_args(name, {k: v for k, v in args.items()
                                                if k not in ("num_clients", "seed")})
        parts = PARTITIONERS[name](train.y, args["num_clients"], seed, **kwargs)
        tests = []
        if args.get("test") == "matched":
            tests = client_test.matched_test(train.y, _pool(cfg, "test_split").y,
                                             train.num_classes, seed, parts=parts)
        _DRAWS[key] = parts, tests
    return _DRAWS[key]


@pytest.mark.parametrize("command", TFDS_COMMANDS, ids=_cmd_id)
def test_command_partition_can_be_drawn(command):
    """The partition (and a matched test draw) on the real class counts, as ``federate``
    calls them; the full federation is built by the slow test below."""
    cfg = _config(command)
    parts, tests = _draw(cfg)
    assert len(parts) == cfg.dataset_args["num_clients"]
    assert all(p.size > 0 for p in parts), "every client must have data"
    assert all(t.size > 0 for t in tests), "every client must have test data"
    C.validate_against_data(cfg, len(parts))  # cohort <= N, full sampler == N


@pytest.mark.slow
@pytest.mark.parametrize("command", TFDS_COMMANDS, ids=_cmd_id)
def test_command_builds_its_federation(command, monkeypatch):
    cfg = _config(command)
    ds = _federation(cfg, monkeypatch)
    C.validate_against_data(cfg, ds.num_clients)  # cohort <= N, full sampler == N
    assert ds.num_clients == cfg.dataset_args["num_clients"]
    assert (np.asarray(ds.host_data.train.num_examples) > 0).all(), \
        "every client must have training data"
    assert (np.asarray(ds.host_data.test.num_examples) > 0).all(), \
        "every client must have test data"


def test_documented_partition_facts(monkeypatch):
    """The sizes the page quotes for the A-FedPD, comp-het, FedEvg and SuPerFed splits,
    and A-FedPD's normalisation with the paper's CIFAR-10 statistics."""
    def federation(output_dir):
        (command,) = [c for c in TFDS_COMMANDS if c.endswith(f"-o {output_dir}")]
        return _federation(_config(command), monkeypatch)

    def sizes(output_dir):
        return np.asarray(federation(output_dir).host_data.train.num_examples)

    from fedjax_fair.data.augment import CIFAR10_MEAN, CIFAR10_STD
    x = np.asarray(federation("runs/a_fedpd/c10_iid_lenet").host_data.train.examples["x"])
    np.testing.assert_allclose(x[0, 0, 0, 0, 1:], (0.5 - np.array(CIFAR10_MEAN[1:]))
                               / np.array(CIFAR10_STD[1:]), rtol=1e-5)

    assert (sizes("runs/a_fedpd/c10_dir0.1_lenet") == 500).all()  # K = 50 steps at batch 50
    assert (sizes("runs/a_fedpd/c100_iid_lenet") == 500).all()
    assert (sizes("runs/comp_het/iid") == 1200).all()
    assert (sizes("runs/comp_het/handpick") == 170).all()  # 200 with a 15% local test
    fedevg = sizes("runs/fedevg/cifar10_a0.01_k100")  # 500 each, 80/20 (stratified)
    assert ((fedevg >= 395) & (fedevg <= 400)).all()
    patho = sizes("runs/superfed/patho_mnist_k500")
    assert abs(patho.mean() - 96) < 1 and patho.min() >= 95  # thesis: 96


def test_per_class_dirichlet_cannot_feed_fedevg_clients():
    """Why FedEvg's rows use dirichlet_prior (stated on the page)."""
    from fedjax_fair.data.partition import dirichlet
    y = np.repeat(np.arange(10), MNIST_TRAIN)
    with pytest.raises(ValueError, match="^min_size: "):
        dirichlet(y, 100, 0, alpha=0.01, max_retries=20)


# --------------------------------------------------------------------------- models table


def _models_table(text: str) -> list[tuple]:
    section = text.split("## Models", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not re.fullmatch(r"`\w+`", cells[0]):
            continue
        args = {}
        if cells[1] not in ("—", "-", ""):
            args = C.parse_assignments(cells[1].replace("`", "").split(), "model_args")
        shape = tuple(int(d) for d in cells[2].split("x"))
        rows.append((cells[0].strip("`"), args, shape, int(cells[3]),
                     int(cells[4].replace(",", ""))))
    return rows


MODEL_ROWS = _models_table(_doc_text())


def test_models_table_lists_every_model_of_the_commands():
    assert len(MODEL_ROWS) >= 20
    documented = {r[0] for r in MODEL_ROWS}
    used = {_config(c).model for c in DOC_COMMANDS}
    assert used <= documented, used - documented


@pytest.mark.parametrize("row", MODEL_ROWS, ids=lambda r: f"{r[0]}-{r[2]}-{r[3]}")
def test_models_table_parameter_counts(row):
    from fedjax_fair.models import MODELS
    name, args, shape, classes, count = row
    assert name in MODELS, f"model {name!r} is not registered in fedjax_fair.models.MODELS"
    margs = C.validate_model_args(name, args, MODELS)
    assert _num_params(name, shape, classes, _frozen(margs)) == count


# ------------------------------------------------------------------------ Python snippets


def _fake_npz(path):
    """A MedMNIST-like .npz (dict of arrays): colour if 'derma' is in the name."""
    rng = np.random.default_rng(0)
    colour, classes = ("derma" in str(path)), (7 if "derma" in str(path) else 11)
    shape = (4, 4, 3) if colour else (4, 4)
    out = {}
    for split, n in (("train", 60 * classes), ("test", 10 * classes)):
        out[f"{split}_labels"] = (np.arange(n) % classes).reshape(n, 1).astype(np.uint8)
        out[f"{split}_images"] = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    return out


@pytest.fixture(scope="module")
def snippets():
    mp = pytest.MonkeyPatch()
    mp.setattr(tfds_source, "load_tfds", fake_load_tfds)
    mp.setattr(np, "load", _fake_npz)
    namespace: dict = {"__name__": "docs_datasets_snippets"}
    try:
        for body in code_blocks(_doc_text(), "python"):
            exec(compile(body, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        mp.undo()


SNIPPET_FUNCTIONS = ("natural_federation", "run_dataset", "mnist_raw_pixels", "femnist_skewed", "fashion_mnist_three", "medmnist")


def test_every_snippet_function_is_exercised(snippets):
    defined = {k for k, v in snippets.items() if callable(v)
               and getattr(v, "__module__", None) == "docs_datasets_snippets"}
    assert defined == set(SNIPPET_FUNCTIONS)


def _labels(ds, k, split="train"):
    d = getattr(ds.host_data, split)
    return np.asarray(d.examples["y"][k])[np.asarray(d.mask[k])]


def _tabular(num_clients=7, n=140):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 15)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return x, y, rng.permutation(np.arange(n) % num_clients) + 10


def _berka(snippets):
    x, y, region = _tabular()
    return snippets["natural_federation"](x, y, region, name="berka", num_classes=2)


def _berka_run(snippets, ds):
    return snippets["run_dataset"](
        ds, "logreg", optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(1.0)),
        batch_size=20, num_epochs=1, num_rounds=2, cohort_size=7, full_participation=True,
        eval_every=2)


def test_snippet_natural_federation(snippets):
    ds = _berka(snippets)
    assert ds.num_clients == 7 and ds.input_shape == (15,)
    train = np.asarray(ds.host_data.train.num_examples)
    test = np.asarray(ds.host_data.test.num_examples)
    assert (train + test == 20).all() and (test >= 3).all()  # 80/20 per client


def test_snippet_run_dataset_wiring(snippets, monkeypatch):
    """run_dataset hands ff.run what the CLI would (the real run is the slow test)."""
    import fedjax_fair
    calls = []
    monkeypatch.setattr(fedjax_fair, "run", lambda *a, **k: calls.append((a, k)) or "ran")
    ds = _berka(snippets)
    assert _berka_run(snippets, ds) == "ran"
    (algorithm, params, data, _), kw = calls[0]
    assert data is ds.host_data and kw["sampler"] is fedjax_fair.scenarios.sampling.full
    assert (kw["num_rounds"], kw["cohort_size"], kw["eval_every"]) == (2, 7, 2)
    assert kw["model"].name == "logreg"
    expected = jax.eval_shape(get_model("logreg", (15,), 2).init, jax.random.key(0))
    assert jax.tree.map(np.shape, params) == jax.tree.map(lambda s: s.shape, expected)
    assert callable(algorithm.init) and callable(algorithm.apply)


@pytest.mark.slow
def test_snippet_run_dataset_runs(snippets):
    result = _berka_run(snippets, _berka(snippets))
    assert [h["round"] for h in result.history] == [0, 2]
    assert np.isfinite(result.history[-1]["accuracy_mean"])


def test_snippet_mnist_raw_pixels(snippets):
    ds = snippets["mnist_raw_pixels"]("unbalanced_shards", shard_size=100)
    x = np.asarray(ds.host_data.train.examples["x"])
    assert ds.num_clients == 50 and x.max() > 1.0 and x.max() <= 255.0
    assert ds.info["partition_params"] == {"shard_size": 100}


def test_snippet_femnist_skewed(snippets):
    ds = snippets["femnist_skewed"]()
    assert ds.num_clients == 100 and ds.num_classes == 10
    for k in range(ds.num_clients):
        labels = _labels(ds, k)
        assert labels.max() <= 9 and np.unique(labels).size == 5
        assert set(np.unique(_labels(ds, k, "test"))) <= set(np.unique(labels))


def test_snippet_fashion_mnist_three(snippets):
    ds = snippets["fashion_mnist_three"]()
    classes = [np.unique(_labels(ds, k)) for k in range(ds.num_clients)]
    assert ds.num_clients == 3 and all(c.size == 1 for c in classes)
    assert sorted(int(c[0]) for c in classes) == [0, 1, 2]
    assert all(_labels(ds, k).size == 6000 for k in range(3))


@pytest.mark.parametrize("name, classes, channels", [("dermamnist", 7, 3),
                                                     ("organcmnist", 11, 1)])
def test_snippet_medmnist(snippets, name, classes, channels):
    ds = snippets["medmnist"](f"/data/medmnist/{name}_64.npz", name=name,
                              num_classes=classes, num_clients=10, alpha=0.01)
    assert ds.num_clients == 10 and ds.num_classes == classes
    assert ds.input_shape[-1] == channels
    x = np.asarray(ds.host_data.train.examples["x"])
    assert 0.0 <= x.min() and x.max() <= 1.0


# ------------------------------------------------------- docs/reproducing.md commands

REPRODUCING = commands((ROOT / "experiments" / "reproducing_template.md").read_text("utf-8"))


@pytest.mark.parametrize("command", REPRODUCING, ids=[c[:50] for c in REPRODUCING])
def test_reproducing_full_scale_commands_validate(command):
    """The full-scale commands of docs/reproducing.md (its template) pass the CLI's
    validation, and the experiment configs they stand beside do too."""
    assert REPRODUCING
    _config(command)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml")))
def test_experiment_configs_validate(name):
    cfg = _config(f"fedjax-fair compare --config {ROOT / 'experiments' / (name + '.yaml')}")
    assert cfg.algorithms
