"""TreeAttention: absorbed-MLA attention of tree tokens over the committed latent cache and their own new KV."""
