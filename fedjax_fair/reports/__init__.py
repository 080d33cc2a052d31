"""Reports: the tables, figures, files and pages of finished simulations, as small
functions of plain data, so notebooks call the same functions as the command line.

Everything here takes plain Python / NumPy data: ``RunResult.history`` (a list of
dicts, one per evaluation, with ``"round"``, ``"accuracy_mean"``,
``"accuracy_worst_10%"``, ``"test_loss"``, ``"seconds"``, ...; see
``drivers.runner.split_summary``) and per-client arrays (``RunResult.client_metrics``).

* ``files``: JSON, JSON lines and CSV written whole or not at all.
* ``tables``: comparison tables grouped by family (Markdown and CSV).
* ``figures``: accuracy curves, histograms, box plots, ECDF, Lorenz curves (Agg
  canvas; importing never touches a notebook's matplotlib backend).
* ``html``: one self-contained page of Markdown and figures (``report.html``).

The names of ``files``, ``tables`` and ``figures`` are exported here
(``from fedjax_fair import reports; reports.plot_lorenz(...)``).
"""
from fedjax_fair.reports.figures import *  # noqa: F401,F403
from fedjax_fair.reports.figures import _legend, _new_figure, _title  # noqa: F401
from fedjax_fair.reports.files import *  # noqa: F401,F403
from fedjax_fair.reports.tables import *  # noqa: F401,F403
from fedjax_fair.reports.tables import _fmt  # noqa: F401
