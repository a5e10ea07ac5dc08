"""The parameter server: the shard actors, their pure version book, compression and replies."""
