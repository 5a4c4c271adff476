"""What a measured score is compared with: the paper's own trajectories (:mod:`.paper`) and the
range of a random ``W_qk`` of the same shape (:mod:`.random_range`)."""
