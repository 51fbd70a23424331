"""`ddtree::Int4MoE`: the routed experts of a MoE layer with INT4 (W4A16) packed weights."""
