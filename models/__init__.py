"""Model definitions: configs (import-light) and the per-rank torch modules of the target and the drafter."""
