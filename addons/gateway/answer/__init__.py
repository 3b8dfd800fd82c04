"""The answer's pipeline, built in one place: assemble and commit the turn, strip the token
fields the proxy asked for, translate, hold for response hooks, capture for replay."""
