"""Who may change the agent over HTTP: the rules the agent and the dashboard both apply."""
