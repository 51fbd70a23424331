"""AllReduce (sum of row-parallel partials) and AllGather (vocab-parallel logits, concatenated on the last axis)."""
