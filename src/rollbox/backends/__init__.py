"""Sandbox backends. Each owns how one kind of sandbox is started, run and torn down on a node;
none of them knows about the HTTP API, IAM or placement."""
