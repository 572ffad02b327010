"""Training-data views: experience turned into SFT, preference, GRPO, unpaired, stepwise and replay rows.

A view is declared once (``ViewSpec``, ``db.create_view``), computed by DuckDB over a
snapshot, and *materialized*: its rows stored beside the database pinned to the commit they
were computed at (``db.materialize``). ``db.refresh`` brings it to the latest commit by
recomputing only the groups and nodes the commits since touched; the result equals a full
rebuild. Rows hold artifact *hashes*; the texts they name are resolved when the view is
materialized and kept beside the rows (``texts.py``), so that ``db.export`` (``export.py``)
only reads and writes them in the layouts trainers read.

Every view starts from the nodes a TQL condition selects (``where``), each with a score
(``reward``, any TQL expression, e.g. ``reward('correct')``), and the node's prompt /
response / system artifacts (by role name). The kinds (one file each in ``kinds/``):

==============  ==============================================================
kind            one row per
==============  ==============================================================
``sft``         node with ``reward >= threshold`` (all selected if no threshold);
                with ``path=True`` its root-to-node path (first parents), a
                prompt and a response per step (a multi-turn conversation)
``preference``  (chosen, rejected): siblings (same parent, or same prompt) whose
                rewards differ by at least ``margin`` (ties never pair), and
                explicit ``comparisons`` (majority of votes; they override
                rewards for the pairs they judge); one row per pair
``grpo``        group (the children of a parent, or the nodes of one prompt)
                with ``min_size`` members or more: rewards and advantages
                ``(r - mean) / std`` (population std; 0 when the group has no
                variance, or the group is dropped with ``drop_zero_variance``)
``kto``         node, labelled desirable when ``reward >= threshold``
``stepwise``    trajectory: from each selected node without selected children
                back to its root along first parents (the smallest parent id),
                with a label per step (``reward >= threshold``)
``replay``      sampled node: ``size`` of them without replacement, priority
                ``|advantage|`` within the parent group (``strategy='advantage'``)
                or by the group's success-rate bucket (``strategy='bucket'``,
                ExGRPO-style: medium-difficulty groups first, lower
                ``entropy`` channel first); deterministic under ``seed``
==============  ==============================================================

The package, bottom up: ``options.py`` (the options), ``texts.py`` (the kept texts),
``sql.py`` (the SQL the kinds share), ``kinds/`` (one file per kind, and the registry),
``spec.py`` (``ViewSpec``: the options checked), ``catalog.py`` (``views.json``),
``rows.py`` (the stored rows), ``compute.py`` (a view's rows as of a snapshot),
``refresh.py`` (the incremental refresh), ``export.py`` (the datasets written) and
``service.py`` (``ViewStore``: one open database's views).

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db")
>>> with db.session(task="t", agent="a") as s:
...     root = s.add_node(summary="root", artifacts={"prompt": "pack 26 circles"})
...     for i, score in enumerate([0.2, 0.9, 0.5]):
...         n = s.add_node(parents=[root], artifacts={"prompt": "pack 26 circles", "response": f"try {i}"})
...         s.add_reward(n, "score", score)
>>> v = db.create_view("prefs", "preference", reward="reward('score')", margin=0.35)
>>> db.materialize("prefs")["rows"]
2
>>> sorted(round(r["margin"], 6) for r in db.view("prefs").to_pylist())
[0.4, 0.7]
"""

from trellisdb.training.catalog import ViewCatalog
from trellisdb.training.kinds import KINDS, ROW_KEYS, SCHEMAS, ViewKind
from trellisdb.training.options import LINEAGE, ViewOptions
from trellisdb.training.service import ViewStore
from trellisdb.training.spec import ViewSpec

__all__ = ["KINDS", "LINEAGE", "ROW_KEYS", "SCHEMAS", "ViewCatalog", "ViewKind", "ViewOptions", "ViewSpec",
           "ViewStore"]
