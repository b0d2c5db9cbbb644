//! Broker adapters for idem: deliveries with ackers, and publishers for the relay.
