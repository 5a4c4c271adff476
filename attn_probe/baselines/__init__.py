"""What a measured score is compared with: the paper's own trajectories (:mod:`.paper`), its scores
of pretrained models (:mod:`.pretrained`) and the range of a random ``W_qk`` of the same shape
(:mod:`.random_range`)."""
# Data shipped here (values, not code): paper_trajectories.csv (:mod:`.paper`) and paper_pretrained_scores.csv
# (:mod:`.pretrained`), from the scores Saponati et al. (ICML 2025, arXiv 2502.10927) released in
# https://github.com/matteosaponati/attention-geometry; each file's header and module docstring say which files and when.
