"""Multi-draft and token-tree verification: SpecTr K-SEQ and recursive rejection sampling, by phase.

No host synchronisation, no Python loop over requests or nodes. Everything that does not depend on
the random path runs before the walk, split over the vocabulary; the walk itself reads no logits row
(except RRS positions with more than RRS_MAX candidates):

1. ``positions._tree_positions_kernel`` grid (requests): the positions a walk can reach (node sets
   spelling the same token path, named by their first node), their candidate counts, first
   candidates and the first candidates' tokens by rank - from the tree alone - and the rows they
   use (sampled requests with draft distributions; greedy and one-hot calls skip it).
2. ``row_pass._verify_row_stats_kernel`` (shared with chain verification): online max / sum-exp,
   greedy argmax and top-k/top-p thresholds of every used target row and draft row of the tree
   (chunks merged once): later siblings' draft rows are never read (their prefix is the first
   sibling's).
3. K-SEQ: ``rho._tree_rho_kernel`` grid (positions, vocabulary chunks), RHO_ROUNDS launches: g(rho) at
   one round's RHO_POINTS points of the rho* search (``reference.verify_tree.rho_search``) for every
   position with siblings whose search is not done, each followed by ``_tree_rho_step_kernel`` grid
   (positions): the bracket, the stop test and the next round's points. RRS: ``rrs._tree_rrs_kernel``,
   one launch per rejection count j: the mass Z_j of the residual left after the first j candidates
   of every position are rejected.
4. ``walk._tree_walk_kernel`` grid (request tiles): walks each request's tree from the root with the
   gathered p(x), q(x) of the candidates and the precomputed rho / Z_j, writes the accepted path and
   records the race it ends with (position, rho and scale, RRS state).
5. ``race._tree_race_kernel`` grid (request tiles, vocabulary chunks): the recovered / bonus token's
   exponential race over the residual, which - like p and q - is never written to memory;
   ``_tree_finalize_kernel`` merges the chunks' winners.

With ``return_logprobs`` (no top-n; LOGPROBS) the walk also writes the logprob of each token it
knows (accepted, and a greedy request's last) from the record of the row it scored that depth with,
and ``_tree_finalize_kernel`` that of the raced token: one logit load per emitted position.

The semantics (the walk over node *sets*, so repeated sibling tokens act with multiplicity) are
specified by ``specdec_kernels.reference.verify_tree``. ``plan.plan_tree`` computes a call's tiles,
grids and chunks once (``plan.TreePlan``); ``launch.launch_tree`` runs the phases on it; the records
the phases pass each other and the device functions they share are in ``common``.
"""

from .launch import launch_tree

__all__ = ["launch_tree"]
