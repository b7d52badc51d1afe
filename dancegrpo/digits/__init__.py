"""The digits world: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes;
shipped inside the wheel, nothing downloaded) as a small, real text-to-image task that trains
and runs offline on CPU. `data` renders the digits and writes their prompts; the rewards
`digit` and `digit_heldout` (dancegrpo.rewards.digit) score whether an image shows the prompted
digit."""
