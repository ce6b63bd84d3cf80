"""The client side, once for every transport: the client step (`bayesfl.client.step`)
that the simulator's executor and the Flower ClientApp both call, with the client state behind
a small store (`ClientStore`)."""
