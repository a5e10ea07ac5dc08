"""A run on the client: the handle a user holds and the pieces it is made of (lifecycle, placement,
launch, supervision and regroups, checkpoints, requests from other clients, `auto`, health, views, export)."""
