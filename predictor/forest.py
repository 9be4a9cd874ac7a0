"""XGBoost ensembles compiled to numpy arrays, so the hot path never calls into XGBoost.

Why: XGBoost's `inplace_predict` has a fixed cost of ~200 µs per call on this class of machine
(argument JSON, a proxy DMatrix, thread setup), whatever the model size, and a pool has four
regressors: ~1 ms per routed request. Here every tree of every regressor is laid out as a full
binary heap of the same depth (a leaf above the bottom becomes an always-left chain), so one pass
of `depth` vectorised steps walks all trees for all candidates at once:

    pos = 0;  repeat depth times:  pos = 2·pos + 1 + (x[feature[pos]] >= threshold[pos])

and a 0/1 matrix sums each regressor's leaves. XGBoost's rule is the same (`x < split` goes left,
the right child otherwise); rows never hold NaN (features.py), so default directions do not arise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from predictor.types import FloatArray

IntArray = npt.NDArray[np.intp]


@dataclass(frozen=True, slots=True)
class _Tree:
    left: list[int]
    right: list[int]
    feature: list[int]
    condition: list[float]  # split threshold for inner nodes, leaf value for leaves

    def depth(self, node: int = 0) -> int:
        if self.left[node] < 0:
            return 0
        return 1 + max(self.depth(self.left[node]), self.depth(self.right[node]))


def _parse_model(model_json: bytes) -> tuple[float, list[_Tree]]:
    """Base score and trees of a single-output XGBoost `gbtree` model saved as JSON."""
    model: dict[str, Any] = json.loads(model_json)
    learner = model["learner"]
    booster = learner["gradient_booster"]
    if booster["name"] != "gbtree":
        raise ValueError(f"only gbtree models compile, got {booster['name']!r}")
    params = learner["learner_model_param"]
    if int(params.get("num_target", "1")) != 1 or int(params.get("num_class", "0")) > 1:
        raise ValueError("only single-output regressors compile")
    base = float(str(params["base_score"]).strip("[]"))
    trees = [
        _Tree(t["left_children"], t["right_children"], t["split_indices"], t["split_conditions"])
        for t in booster["model"]["trees"]
    ]
    return base, trees


@dataclass(frozen=True, slots=True)
class CompiledForest:
    """Several single-output regressors evaluated together; `predict` returns one column each.

    Node arrays are indexed by a global node id: tree t's heap node h is `t·(2**(depth+1) - 1) + h`,
    so a step is `node = left[node] + (x >= threshold[node])` (the right child follows the left).
    """

    depth: int
    feature: IntArray  # (nodes,) feature index of each inner node (0 for padding and leaves)
    threshold: FloatArray  # (nodes,) go right when x >= threshold (+inf for padding: always left)
    left: IntArray  # (nodes,) global id of the left child (leaves: themselves)
    value: FloatArray  # (nodes,) leaf values at the bottom level, 0 elsewhere
    roots: IntArray  # (trees,) global id of each tree's root
    output_of_tree: FloatArray  # (trees, outputs) 0/1: which regressor a tree belongs to
    base_score: FloatArray  # (outputs,)

    @property
    def num_outputs(self) -> int:
        return int(self.base_score.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.roots.shape[0])

    @classmethod
    def compile(cls, models_json: Sequence[bytes]) -> CompiledForest:
        """Compile XGBoost JSON models (`Booster.save_raw("json")`), one output column each."""
        parsed = [_parse_model(m) for m in models_json]
        trees = [(output, tree) for output, (_, ts) in enumerate(parsed) for tree in ts]
        depth = max((tree.depth() for _, tree in trees), default=0)
        per_tree = 2 ** (depth + 1) - 1
        inner = 2**depth - 1
        n = len(trees)
        feature = np.zeros(n * per_tree, dtype=np.intp)
        threshold = np.full(n * per_tree, np.inf, dtype=np.float32)
        heap = np.arange(per_tree, dtype=np.intp)
        local_left = np.where(heap < inner, 2 * heap + 1, heap)
        roots = np.arange(n, dtype=np.intp) * per_tree
        left = (roots[:, None] + local_left[None, :]).ravel()
        value = np.zeros(n * per_tree, dtype=np.float32)
        output_of_tree = np.zeros((n, len(parsed)), dtype=np.float32)
        for t, (output, tree) in enumerate(trees):
            output_of_tree[t, output] = 1.0
            _layout(tree, 0, 0, depth, int(roots[t]), feature, threshold, value)
        return cls(
            depth=depth,
            feature=feature,
            threshold=threshold,
            left=left,
            value=value,
            roots=roots,
            output_of_tree=output_of_tree,
            base_score=np.array([base for base, _ in parsed], dtype=np.float32),
        )

    def predict(self, rows: FloatArray) -> FloatArray:
        """(len(rows), num_outputs) float32 margins, equal to XGBoost's predictions."""
        n_rows, n_features = rows.shape
        flat = np.ascontiguousarray(rows, dtype=np.float32).ravel()
        row_offset = (np.arange(n_rows, dtype=np.intp) * n_features)[:, None]
        node = self.roots  # (trees,): broadcasts against row_offset into (rows, trees) at the first step
        for _ in range(self.depth):
            go_right = flat[row_offset + self.feature[node]] >= self.threshold[node]
            node = self.left[node] + go_right
        leaves = self.value[np.broadcast_to(node, (n_rows, self.num_trees))]
        out: FloatArray = leaves @ self.output_of_tree + self.base_score
        return out


def _layout(
    tree: _Tree,
    node: int,
    heap: int,
    depth: int,
    root: int,
    feature: IntArray,
    threshold: FloatArray,
    value: FloatArray,
) -> None:
    """Place `node` of `tree` at heap position `heap`; a leaf fills its whole heap subtree."""
    inner = 2**depth - 1
    if heap >= inner:  # bottom level: a leaf slot
        value[root + heap] = tree.condition[node]
        return
    if tree.left[node] < 0:  # a leaf above the bottom: always-left padding down to its leaf slots
        first, count = heap, 1
        while first < inner:
            first, count = 2 * first + 1, count * 2
        value[root + first : root + first + count] = tree.condition[node]
        return
    feature[root + heap] = tree.feature[node]
    threshold[root + heap] = tree.condition[node]
    _layout(tree, tree.left[node], 2 * heap + 1, depth, root, feature, threshold, value)
    _layout(tree, tree.right[node], 2 * heap + 2, depth, root, feature, threshold, value)
