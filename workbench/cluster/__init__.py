"""The cluster: connecting to or starting one, leases of workers to runs, membership, run announcements."""
