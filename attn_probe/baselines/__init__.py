"""What a measured score is compared with: the paper's own trajectories (:mod:`.paper`), its scores
of pretrained models (:mod:`.pretrained`) and the range of a random ``W_qk`` of the same shape
(:mod:`.random_range`)."""
# The paper's scores of pretrained models (paper_pretrained_scores.csv, :mod:`.pretrained`): values (not code) read
# 2026-11-28 from the same repository's _results/table-symmetry-scores-language.txt and
# _results/table-directionality-scores-language.txt, as released (faults included; pretrained.py says how each is treated).
