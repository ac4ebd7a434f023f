"""The vision sides of the image-text models: each family's image processor and vision encoder
(the contract of `multimodal.inputs`)."""
