//! What every publisher offers for bodies as they are (`idem publish`, tests, scripts),
//! written once: [`raw_publishing!`].

/// A broker's `publish_raw`, twice: the method of `$publisher` (its own
/// `publish_raw_with_headers`, without headers) and its module's function (a
/// `$publisher::connect` with the arguments named, then that method). The docs of each
/// come before it.
macro_rules! raw_publishing {
    (
        $(#[$method_doc:meta])*
        method of $publisher:ident;
        $(#[$fn_doc:meta])*
        fn publish_raw($($arg:ident: $ty:ty),*);
    ) => {
        impl $publisher {
            $(#[$method_doc])*
            pub async fn publish_raw(&self, bodies: &[Vec<u8>]) -> Result<(), crate::BrokerError> {
                self.publish_raw_with_headers(bodies, &[]).await
            }
        }

        $(#[$fn_doc])*
        pub async fn publish_raw(
            $($arg: $ty,)*
            bodies: &[Vec<u8>],
        ) -> Result<(), crate::BrokerError> {
            $publisher::connect($($arg),*)
                .await?
                .publish_raw(bodies)
                .await
        }
    };
}

pub(crate) use raw_publishing;
