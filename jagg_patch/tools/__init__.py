"""Analysis and benchmark tools; they reach dancegrpo through jagg_patch.seams as the patch does."""
